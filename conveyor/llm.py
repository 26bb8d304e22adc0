"""The offline Python API: `LLM(model=path).generate(prompts, SamplingParams(...))`.

Runs the same code as the daemon, in this process: the tokenizer stage's PromptEncoder, the
scheduler stage's Scheduler (continuous batching, chunked prefill, paged KV), the worker's
ModelRunner, and the detokenizer stage's IncrementalDetokenizer. No sockets, no child processes.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Sequence as Seq

import msgspec
from tokenizers import Tokenizer

from conveyor.config.build import build_engine_config
from conveyor.stages.detokenizer.incremental import IncrementalDetokenizer
from conveyor.stages.scheduler.block_manager import BlockManager
from conveyor.stages.scheduler.plan import PROMPT_TAIL_TOKENS, step_plan
from conveyor.stages.scheduler.scheduler import Scheduler
from conveyor.stages.scheduler.sequence import Sequence
from conveyor.stages.tokenizer.encoder import PromptEncoder
from conveyor.stages.tokenizer.main import Rejected, prepare
from conveyor.wire.messages import ChatMessage, SamplingParams, TokenizeRequest


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    cumulative_logprob: float = 0.0


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache


class LLM:
    """An engine in this process. Keyword arguments are those of `conveyor serve`."""

    def __init__(self, model: str | None = None, **options):
        self.config = build_engine_config(model, **options)
        from conveyor.gpu.runner import ModelRunner  # torch loads only with the engine

        self.encoder = PromptEncoder(self.config.model.path)
        self.tokenizer = Tokenizer.from_file(f"{self.config.model.path}/tokenizer.json")
        self.runner = ModelRunner(self.config)
        num_blocks = self.runner.num_available_blocks()
        self.runner.initialize_cache(num_blocks)
        self.scheduler = Scheduler(
            self.config.scheduler,
            BlockManager(
                num_blocks,
                self.config.cache.block_size,
                enable_prefix_caching=self.config.scheduler.enable_prefix_caching,
            ),
            max_model_len=self.config.model.max_model_len,
            eos_token_ids=self.config.model.eos_token_ids,
        )
        self._ids = itertools.count()

    def generate(
        self,
        prompts: str | Seq[str] | Seq[int] | Seq[Seq[int]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate for each prompt (text, or a list of token ids); outputs in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        requests = [
            TokenizeRequest(f"gen-{next(self._ids)}", 0, SamplingParams(), time.time(), **(
                {"prompt": p} if isinstance(p, str) else {"prompt_token_ids": list(p)}
            ))
            for p in prompts
        ]  # fmt: skip
        return self._run(requests, prompts, sampling_params)

    def chat(
        self,
        messages: Seq[dict] | Seq[Seq[dict]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Apply the checkpoint's chat template to each conversation, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        requests = [
            TokenizeRequest(
                f"chat-{next(self._ids)}", 0, SamplingParams(), time.time(),
                messages=[ChatMessage(m["role"], m["content"]) for m in conv],
                add_generation_prompt=add_generation_prompt,
            )
            for conv in conversations
        ]  # fmt: skip
        return self._run(requests, [None] * len(requests), sampling_params)

    def _run(self, requests: list[TokenizeRequest], prompts: list, sampling_params) -> list[RequestOutput]:
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(requests)
        if len(sampling_params) != len(requests):
            raise ValueError("give one SamplingParams, or one per prompt")
        for req, params in zip(requests, sampling_params):
            req = msgspec.structs.replace(req, params=params)
            try:
                scheduled = prepare(self.encoder, self.config, req)
            except Rejected as e:
                raise ValueError(str(e)) from None
            self.scheduler.add_request(scheduled)
        samples = self._drain()
        outputs = []
        for req, prompt in zip(requests, prompts):
            seqs = sorted(samples[req.request_id], key=lambda s: s.index)
            if seqs[0].params.num_samples > seqs[0].params.n:  # best_of: the n most likely
                seqs = sorted(seqs, key=lambda s: -s.cumulative_logprob)[: seqs[0].params.n]
            outputs.append(
                RequestOutput(
                    request_id=req.request_id,
                    prompt=prompt if isinstance(prompt, str) else None,
                    prompt_token_ids=seqs[0].token_ids[: seqs[0].num_prompt_tokens],
                    outputs=[self._completion(seq, i) for i, seq in enumerate(seqs)],
                    num_cached_tokens=seqs[0].num_cached_tokens,
                )
            )
        return outputs

    def _drain(self) -> dict[str, list[Sequence]]:
        """Step until every request finished; each request's sequences (all its samples)."""
        samples: dict[str, dict[int, Sequence]] = {}
        while self.scheduler.has_work():
            step = self.scheduler.schedule()
            if step is None:
                updates = self.scheduler.take_aborted_updates()
            else:
                result = self.runner.execute(step_plan(step))
                updates = self.scheduler.update(step, result.sampled_token_ids, result.sampled_logprobs)
            for update in updates:
                samples.setdefault(update.seq.request_id, {})[update.seq.seq_id] = update.seq
        return {request_id: list(seqs.values()) for request_id, seqs in samples.items()}

    def _completion(self, seq: Sequence, index: int) -> CompletionOutput:
        tail = seq.token_ids[max(0, seq.num_prompt_tokens - PROMPT_TAIL_TOKENS) : seq.num_prompt_tokens]
        decoder = IncrementalDetokenizer(self.tokenizer, tail, seq.params.skip_special_tokens)
        text = decoder.step(seq.output_token_ids, final=True)
        reason = seq.finish_reason.openai if seq.finish_reason is not None else None
        return CompletionOutput(index, text, seq.output_token_ids, reason, seq.cumulative_logprob)
