"""The offline Python API: `LLM(model=path).generate(prompts, SamplingParams(...))`.

Runs the same code as the daemon, in this process: the tokenizer stage's PromptEncoder, the
scheduler stage's EngineCore (continuous batching, chunked prefill, paged KV), the worker's
ModelRunner, and the detokenizer stage's Detokenizer (stop strings, logprob text), each plan run
to its end. No sockets, no child processes.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Mapping
from collections.abc import Sequence as Seq
from typing import Any, cast

import msgspec
from tokenizers import Tokenizer

from conveyor.config.lora_adapter import read_adapter_info
from conveyor.config.pooling import check_dimensions
from conveyor.engine_config import build_engine_config
from conveyor.llm_images import chat_messages, prompt_images
from conveyor.stages.detokenizer.detokenizer import Detokenizer
from conveyor.stages.scheduler.adapters import adapters_for
from conveyor.stages.scheduler.engine_core import EngineCore
from conveyor.stages.scheduler.plan import token_batches
from conveyor.stages.tokenizer.encoder import PromptEncoder
from conveyor.stages.tokenizer.preparation import Rejected, prepare
from conveyor.wire.messages import Pooling, SamplingParams, TextDelta, TextLogprob, TokenizeRequest

# Text, token ids, or vLLM's dict with "prompt" or "prompt_token_ids" and "multi_modal_data".
Prompt = str | Seq[int] | Mapping[str, Any]
READ_WAIT_S = 0.05  # with nothing to run but reads from the KV disk tier: how long to wait before planning again


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length", or "error": its logits were not finite, it ended
    cumulative_logprob: float | None = None  # with logprobs or best_of; None otherwise (as vLLM)
    logprobs: list[TextLogprob] = dataclasses.field(default_factory=list)  # when asked for
    stop_reason: str | int | None = None  # the stop string, or stop token id, that ended it


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    """A LoRA adapter for a prompt (`LLM.generate(..., lora_request=...)`): a PEFT adapter
    directory, served under `name` (registered on first use; needs `enable_lora=True`)."""

    name: str
    path: str


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # SamplingParams.prompt_logprobs: None for the first prompt token, then each one's (token_id and rank set).
    prompt_logprobs: list[TextLogprob | None] | None = None
    embedding: list[float] | None = None  # LLM.embed: the prompt's pooled vector


class LLM:
    """An engine in this process. Keyword arguments are those of `conveyor serve`."""

    def __init__(self, model: str | None = None, **options):
        # An offline batch is its own only client: the daemon's admission bounds do not apply.
        options.setdefault("max_queued_requests", 0)
        options.setdefault("max_queued_tokens", 0)
        self.config = build_engine_config(model, **options)
        from conveyor.gpu.step.features.kv_offload import KvOffloadStep  # torch loads only with the engine
        from conveyor.gpu.step.runner import ModelRunner

        self.encoder = PromptEncoder.for_engine(self.config)
        self.tokenizer = Tokenizer.from_file(f"{self.config.model.path}/tokenizer.json")
        self.runner = ModelRunner(self.config)
        num_blocks = self.runner.num_available_blocks()
        self.runner.initialize_cache(num_blocks)
        self.core = EngineCore.from_config(
            self.config.scheduler,
            num_blocks=num_blocks,
            block_size=self.config.cache.block_size,
            max_model_len=self.config.model.max_model_len,
            eos_token_ids=self.config.model.eos_token_ids,
            speculative=self.config.speculative,
            adapters=adapters_for(self.config),
            num_host_slots=offload.num_slots if (offload := self.runner.feature(KvOffloadStep)) is not None else 0,
            kv_warm=offload.warm if offload is not None else None,
            num_disk_blocks=offload.num_disk_blocks if offload is not None else 0,
            kv_disk=offload.disk_names() if offload is not None else None,
        )
        self.offload = offload  # the KV tiers' byte mover: its reads from disk are answered here
        self.detokenizer = Detokenizer(self.tokenizer)
        self._ids = itertools.count()
        self._cached_tokens: dict[str, int] = {}
        self._prompt_logprobs: dict[str, list[TextLogprob]] = {}  # by request, from its first delta
        self._embeddings: dict[str, list[float]] = {}  # by request, a pooling request's vector

    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for each prompt (text, a list of token ids, or vLLM's dict: {"prompt" or
        "prompt_token_ids", "multi_modal_data": {"image": ...}}, llm_images.py); outputs in
        prompt order. `lora_request`: one adapter for every prompt, or one (or None: the base) per prompt."""
        single = isinstance(prompts, (str, Mapping)) or (prompts and isinstance(prompts[0], int))
        batch = cast(Seq[Prompt], [prompts] if single else prompts)  # the check mypy cannot follow
        requests = [self._prompt_request(p, i) for i, p in enumerate(batch)]
        texts = [p if isinstance(p, str) else p.get("prompt") if isinstance(p, Mapping) else None for p in batch]
        return self._run(requests, texts, sampling_params, lora_request)

    def _prompt_request(self, prompt: Prompt, at: int) -> TokenizeRequest:
        request = TokenizeRequest(f"gen-{next(self._ids)}", 0, SamplingParams(), time.time())
        if isinstance(prompt, str):
            return msgspec.structs.replace(request, prompt=prompt)
        if not isinstance(prompt, Mapping):
            return msgspec.structs.replace(request, prompt_token_ids=list(prompt))
        text, ids = prompt.get("prompt"), prompt.get("prompt_token_ids")
        if (text is None) == (ids is None):
            raise ValueError(f"prompts[{at}]: give one of prompt and prompt_token_ids")
        ids = None if ids is None else list(ids)
        return msgspec.structs.replace(request, prompt=text, prompt_token_ids=ids, images=prompt_images(prompt, at))

    def embed(self, prompts: str | Seq[str] | Seq[int] | Seq[Seq[int]], dimensions: int | None = None) -> list[RequestOutput]:
        """Each prompt's vector (`RequestOutput.embedding`), from an embedding checkpoint's pooling
        (config/pooling.py), cut to `dimensions` where the model allows it; outputs in prompt order."""
        pooling = self.config.model.pooling
        if pooling is None:
            raise ValueError(f"{self.config.model.served_name} generates text: it has no pooling (modules.json) to embed with")
        check_dimensions(pooling, self.config.model.hidden_size, dimensions)
        return self.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1, pooling=Pooling(dimensions)))

    def chat(
        self,
        messages: Seq[dict] | Seq[Seq[dict]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Apply the checkpoint's chat template to each conversation, then generate. A message's
        content is text, or a list of text and image parts (llm_images.py)."""
        single = messages and isinstance(messages[0], dict)
        conversations = cast(Seq[Seq[dict]], [messages] if single else messages)  # the check mypy cannot follow
        requests = [
            TokenizeRequest(
                f"chat-{next(self._ids)}",
                0,
                SamplingParams(),
                time.time(),
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                images=images,
            )
            for messages, images in map(chat_messages, conversations)
        ]
        return self._run(requests, [None] * len(requests), sampling_params)

    def _run(self, requests: list[TokenizeRequest], prompts: Seq, sampling_params, lora_request=None) -> list[RequestOutput]:
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(requests)
        if len(sampling_params) != len(requests):
            raise ValueError("give one SamplingParams, or one per prompt")
        if lora_request is not None:
            loras = [lora_request] * len(requests) if isinstance(lora_request, LoRARequest) else list(lora_request)
            if len(loras) != len(requests):
                raise ValueError("give one LoRARequest, or one (or None) per prompt")
            sampling_params = [
                p if lora is None else msgspec.structs.replace(p, adapter=self._adapter(lora))
                for p, lora in zip(sampling_params, loras)
            ]
        if self.config.model.pooling is not None and any(p.pooling is None for p in sampling_params):
            raise ValueError(f"{self.config.model.served_name} is an embedding model: use LLM.embed")
        prepared = []
        for req, params in zip(requests, sampling_params):
            try:
                prepared.append(prepare(self.encoder, self.config, msgspec.structs.replace(req, params=params)))
            except Rejected as e:
                raise ValueError(str(e)) from None
        for request in prepared:
            self.core.add_request(request)
        samples = self._drain()
        outputs = []
        for request, prompt in zip(prepared, prompts):
            params = request.params
            choices = sorted(samples[request.request_id].values(), key=lambda c: c.index)
            if params.num_samples > params.n:  # best_of: the n most likely
                choices = sorted(choices, key=lambda c: -(c.cumulative_logprob or 0.0))[: params.n]
            elif params.logprobs is None:  # not computed for every token (gpu/sampling/draws.py): None, as vLLM
                for choice in choices:
                    choice.cumulative_logprob = None
            for i, choice in enumerate(choices):
                choice.index = i
            outputs.append(
                RequestOutput(
                    request_id=request.request_id,
                    prompt=prompt if isinstance(prompt, str) else None,
                    prompt_token_ids=request.prompt_token_ids,
                    outputs=choices,
                    num_cached_tokens=self._cached_tokens.pop(request.request_id, 0),
                )
            )
            prompt_logprobs = self._prompt_logprobs.pop(request.request_id, [])
            if params.prompt_logprobs is not None:
                outputs[-1].prompt_logprobs = [None, *prompt_logprobs[1:]]
            if params.pooling is not None:
                outputs[-1].embedding = self._embeddings.pop(request.request_id)
        return outputs

    def _adapter(self, lora: LoRARequest) -> str:
        """The adapter's name, registered with the scheduler on first use (checked: config/lora_adapter.py)."""
        adapters = self.core.scheduler.adapters
        if adapters is None:
            raise ValueError("a LoRARequest needs LLM(..., enable_lora=True)")
        known = adapters.registry.get(lora.name)
        if known is None:
            lora_config = self.config.lora
            adapters.register(read_adapter_info(lora.name, lora.path, self.config.model, lora_config.max_lora_rank))
        elif known.path != lora.path:
            raise ValueError(f"the adapter name {lora.name!r} is taken by {known.path}")
        return lora.name

    def _drain(self) -> dict[str, dict[int, CompletionOutput]]:
        """Step until every request finished, each plan run to its end, detokenizing each pass
        as the daemon does (stop strings included); every sample of every request, by request
        id and sample index."""
        samples: dict[str, dict[int, CompletionOutput]] = {}
        while self.core.has_work():
            if self.offload is not None and (news := self.offload.take_disk_news()) is not None:
                self.core.kv_disk_changed(news)  # blocks another engine wrote into a shared --kv-disk-dir
            num_steps = self.core.scheduler.num_steps
            for updates in self.core.run_step(self.runner.execute):
                self._detokenize(updates, samples)
            if self.offload is not None and self.offload.reading:  # reads from disk: wait for one if nothing else ran
                if self.core.scheduler.num_steps == num_steps:
                    self.offload.wait_fetched(READ_WAIT_S)
                if (fetched := self.offload.take_fetched()) is not None:
                    self.core.kv_fetched(fetched)
        return samples

    def _detokenize(self, updates: list, samples: dict[str, dict[int, CompletionOutput]]) -> None:
        """As a detokenizer stage would: text deltas into `samples`, and stop strings found end
        their sequences in the scheduler."""
        (batch,) = token_batches(self.core.scheduler.num_steps, updates, 1)
        if batch is not None:
            deltas: list[list[TextDelta]] = [[]]
            self.core.finish_seqs(self.detokenizer.process(batch, deltas))
            for d in deltas[0]:
                choice = samples.setdefault(d.request_id, {}).setdefault(d.index, CompletionOutput(d.index, "", [], None))
                choice.text += d.text
                choice.token_ids += d.token_ids
                choice.logprobs += d.logprobs
                if d.prompt_logprobs:
                    self._prompt_logprobs[d.request_id] = d.prompt_logprobs
                if d.embedding:
                    self._embeddings[d.request_id] = d.embedding
                choice.cumulative_logprob = d.cumulative_logprob
                self._cached_tokens[d.request_id] = d.num_cached_tokens
                if d.finish_reason is not None:
                    choice.finish_reason, choice.stop_reason = d.finish_reason.openai, d.stop_reason
