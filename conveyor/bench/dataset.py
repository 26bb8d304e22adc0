"""The benchmark's requests as text: the simulator's workloads (conveyor.sim.workloads), with
prompt text instead of token ids.

Datasets (`DatasetConfig.name`):
  sharegpt        the first human turn of each conversation is the prompt, the gpt turn after it
                  sets max_tokens (both counted by the server's tokenizer); vLLM's filter
  random          prompt and output lengths uniform in [range_ratio * len, len] (1.0: fixed)
  prefill-heavy   ~462 prompt / 16 output tokens;  decode-heavy: ~462 / 256
  fastgen-P-O     FastGen's normal workloads: mean prompt P, mean output O, 30% spread
  fixed, normal   as in the simulator
Lengths are drawn exactly as the simulator draws them for the same seed; synthetic prompts are
written to those lengths by a PromptMaker. With `num_system_prompts` K > 0, every request of any
dataset also opens with one of K shared system prompts (system_prompts.py), which its prompt
length then counts. Asynchronous because counting may ask the server.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from conveyor.bench.prompts import PromptMaker, TokenCounter, special_tokens
from conveyor.bench.system_prompts import add_system_prompts
from conveyor.sim.workloads import WorkloadConfig, keeps_exchange, sharegpt_exchanges, synthetic_lengths

DATASETS = ("sharegpt", "random", "prefill-heavy", "decode-heavy", "fastgen-P-O", "fixed", "normal")


@dataclasses.dataclass(frozen=True)
class BenchRequest:
    prompt: str
    prompt_len: int  # tokens, as the counter counted the prompt (special tokens included)
    output_len: int  # max_tokens asked for
    system_prompt: str = ""  # shared by other requests (system_prompts.py); "" for none

    @property
    def text(self) -> str:
        """The prompt as one completion prompt: the system prompt, a blank line, the prompt.
        A chat request sends the two as a system and a user message instead."""
        return f"{self.system_prompt}\n\n{self.prompt}" if self.system_prompt else self.prompt


@dataclasses.dataclass(frozen=True)
class DatasetConfig:
    name: str = "random"
    num_prompts: int = 500
    path: str | None = None  # ShareGPT JSON
    input_len: int = 1024  # random, fixed, normal
    output_len: int = 128
    range_ratio: float = 1.0  # random: lower bound / upper bound of each length
    seed: int = 0
    num_system_prompts: int = 0  # K shared system prompts, one opening each request (0: none)
    system_prompt_len: int = 256  # tokens of each

    @property
    def synthetic(self) -> bool:
        return self.name != "sharegpt"

    def workload(self) -> WorkloadConfig:
        return WorkloadConfig(
            kind=self.name,
            num_requests=self.num_prompts,
            seed=self.seed,
            path=self.path,
            prompt_len=self.input_len,
            output_len=self.output_len,
            range_ratio=self.range_ratio,
        )


async def make_dataset(config: DatasetConfig, counter: TokenCounter) -> list[BenchRequest]:
    """`config.num_prompts` requests (fewer only if a ShareGPT file runs out)."""
    requests = await _requests(config, counter, np.random.default_rng(config.seed))
    if config.num_system_prompts:
        requests = await add_system_prompts(requests, config, counter)
    return requests


async def _requests(config: DatasetConfig, counter: TokenCounter, rng: np.random.Generator) -> list[BenchRequest]:
    if not config.synthetic:
        return await _sharegpt(config, counter, rng)
    lengths = synthetic_lengths(config.workload(), rng)
    prompts = await PromptMaker(counter, rng).make([p for p, _ in lengths])
    return [BenchRequest(text, n, output) for (text, n), (_, output) in zip(prompts, lengths)]


async def _sharegpt(config: DatasetConfig, counter: TokenCounter, rng: np.random.Generator) -> list[BenchRequest]:
    if config.path is None:
        raise ValueError("the sharegpt dataset needs --dataset-path (a ShareGPT JSON file)")
    exchanges = sharegpt_exchanges(config.path)
    order = list(rng.permutation(len(exchanges)))
    overhead = await special_tokens(counter)  # a completion is not a prompt: no BOS in its count
    workload = config.workload()
    out: list[BenchRequest] = []
    while order and len(out) < config.num_prompts:
        take = 2 * (config.num_prompts - len(out)) + 16  # more than still needed: the filter drops some
        chunk, order = order[:take], order[take:]
        pairs = [exchanges[i] for i in chunk]
        counts = await counter.count([text for pair in pairs for text in pair])
        for (prompt, _), prompt_len, completion_len in zip(pairs, counts[0::2], counts[1::2]):
            output_len = completion_len - overhead
            if keeps_exchange(prompt_len, output_len, workload) and len(out) < config.num_prompts:
                out.append(BenchRequest(prompt, prompt_len, output_len))
    return out
