"""The benchmark's requests as text: the simulator's workloads (conveyor.sim.workloads), with
prompt text instead of token ids.

Datasets (`DatasetConfig.name`):
  sharegpt        the prompts vLLM's client picks for the seed, in its order, with its max_tokens
                  (conveyor/sim/sharegpt.py), counted by the server's tokenizer
  random          prompt and output lengths uniform in [range_ratio * len, len] (1.0: fixed)
  prefill-heavy   ~462 prompt / 16 output tokens;  decode-heavy: ~462 / 256
  fastgen-P-O     FastGen's normal workloads: mean prompt P, mean output O, 30% spread
  fixed, normal   as in the simulator
  multi-turn      ShareGPT conversations turn by turn: `bench serve` replays them (multi_turn.py)
Lengths are drawn exactly as the simulator draws them for the same seed; synthetic prompts are
written to those lengths by a PromptMaker. With `num_system_prompts` K > 0, every request of any
dataset also opens with one of K shared system prompts (system_prompts.py), which its prompt
length then counts. With `image_fraction` F > 0, that share of the requests also carries generated
pictures as data: URLs (images.py), which only the chat endpoint takes. Asynchronous because
counting may ask the server.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from conveyor.bench.images import add_images
from conveyor.bench.prompts import PromptMaker, TokenCounter
from conveyor.bench.system_prompts import add_system_prompts
from conveyor.sim.sharegpt import Picker, sharegpt_pairs
from conveyor.sim.workloads import WorkloadConfig, synthetic_lengths

MULTI_TURN = "multi-turn"  # not a list of requests: multi_turn.py makes and sends its turns
DATASETS = ("sharegpt", "random", "prefill-heavy", "decode-heavy", "fastgen-P-O", "fixed", "normal", MULTI_TURN)


@dataclasses.dataclass(frozen=True)
class BenchRequest:
    prompt: str
    prompt_len: int  # tokens, as the counter counted the prompt (special tokens included)
    output_len: int  # max_tokens asked for
    system_prompt: str = ""  # shared by other requests (system_prompts.py); "" for none
    images: tuple[str, ...] = ()  # data: URLs sent before the prompt in the user message (images.py)

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
    image_fraction: float = 0.0  # share of the requests that carry images (images.py)
    images_per_request: int = 1
    image_size: tuple[int, int] = (640, 480)  # width, height in pixels
    image_repeat_fraction: float = 0.0  # share of the image requests that resend an earlier one's pictures

    @property
    def synthetic(self) -> bool:
        return self.name not in ("sharegpt", MULTI_TURN)

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
    """`config.num_prompts` requests (a ShareGPT file that runs short repeats picks, as vLLM's does)."""
    if config.name == MULTI_TURN:
        raise ValueError("the multi-turn dataset is replayed by `conveyor bench serve` only")
    requests = await _requests(config, counter, np.random.default_rng(config.seed))
    if config.num_system_prompts:
        requests = await add_system_prompts(requests, config, counter)
    if config.image_fraction:
        requests = add_images(requests, config)
    return requests


async def _requests(config: DatasetConfig, counter: TokenCounter, rng: np.random.Generator) -> list[BenchRequest]:
    if not config.synthetic:
        return await _sharegpt(config, counter)
    lengths = synthetic_lengths(config.workload(), rng)
    prompts = await PromptMaker(counter, rng).make([p for p, _ in lengths])
    return [BenchRequest(text, n, output) for (text, n), (_, output) in zip(prompts, lengths)]


async def _sharegpt(config: DatasetConfig, counter: TokenCounter) -> list[BenchRequest]:
    """vLLM's picks (conveyor/sim/sharegpt.py), counted by `counter` as vLLM's client counts:
    prompt and completion each with the special tokens a server adds."""
    if config.path is None:
        raise ValueError("the sharegpt dataset needs --dataset-path (a ShareGPT JSON file)")
    pairs = sharegpt_pairs(config.path)
    workload = config.workload()
    picker = Picker(len(pairs), config.num_prompts, config.seed, workload.max_prompt_len, workload.max_total_len)
    while chunk := picker.next_chunk():
        counts = await counter.count([text for i in chunk for text in pairs[i]])
        picker.offer(chunk, list(zip(counts[0::2], counts[1::2])))
    return [BenchRequest(pairs[p.index][0], p.prompt_len, p.output_len) for p in picker.picks()]
