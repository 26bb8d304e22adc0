"""Request arrivals for the simulator: ShareGPT conversations or synthetic length distributions,
arriving as a Poisson process at a given rate, or all at time 0. Deterministic given a seed.

Workloads (`WorkloadConfig.kind`):
  sharegpt       the conversations vLLM's benchmark client picks for the seed, in its order, with
                 its output lengths (sharegpt.py: its shuffle, turns and filter)
  fixed          every prompt prompt_len, every output output_len
  random         uniform in [range_ratio * len, len] for both (vLLM's random dataset)
  normal         normal around prompt_len / output_len, standard deviation cv * mean
  fastgen-P-O    FastGen's workloads: normal, mean prompt P (1200 or 2600), mean output O (60 or
                 128), 30% spread (read as a standard deviation of 0.3 * mean)
  prefill-heavy  ~462 prompt / 16 output tokens (vLLM v0.6 benchmark), +-10% uniform
  decode-heavy   ~462 prompt / 256 output tokens, +-10% uniform
Synthetic prompts are random token ids, distinct per request, so a prefix cache finds nothing
shared by accident; ShareGPT prompts are the tokenizer's real ids, special tokens (a BOS) included,
as vLLM's client counts them.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re

import numpy as np

from conveyor.sim.sharegpt import MAX_PROMPT_LEN, MAX_TOTAL_LEN, Picker, sharegpt_pairs

WORDS_TO_TOKENS = 4 / 3  # the usual rule of thumb for English with a Llama-sized vocabulary
SYNTHETIC_VOCAB = 4000  # ids drawn below this (the tiny model's special tokens sit above)
PRESETS = {"prefill-heavy": (462, 16), "decode-heavy": (462, 256)}


@dataclasses.dataclass(frozen=True)
class SimRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    max_tokens: int  # generated exactly: the simulator never samples EOS
    arrival_time: float  # seconds from the start of the run

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclasses.dataclass(frozen=True)
class WorkloadConfig:
    kind: str = "sharegpt"
    num_requests: int = 500
    rate: float = math.inf  # requests per second (Poisson); inf: all arrive at time 0
    seed: int = 0
    path: str | None = None  # ShareGPT JSON
    token_counts: str = "tokenizer"  # ShareGPT: "tokenizer" (tiny model's) or "whitespace"
    tokenizer_path: str | None = None  # tokenizer.json; default: the embedded tiny model's (trained)
    prompt_len: int = 512
    output_len: int = 128
    cv: float = 0.3  # normal: standard deviation / mean
    range_ratio: float = 0.5  # random: lower bound / upper bound
    max_prompt_len: int = MAX_PROMPT_LEN  # ShareGPT filter (vLLM's)
    max_total_len: int = MAX_TOTAL_LEN


def make_requests(config: WorkloadConfig) -> list[SimRequest]:
    """The workload's requests in arrival order."""
    rng = np.random.default_rng(config.seed)
    if config.kind == "sharegpt":
        prompts, outputs = _sharegpt(config, rng)
    else:
        lengths = synthetic_lengths(config, rng)
        prompts = [tuple(int(t) for t in rng.integers(0, SYNTHETIC_VOCAB, p)) for p, _ in lengths]
        outputs = [o for _, o in lengths]
    arrivals = arrival_times(len(prompts), config.rate, rng)
    return [SimRequest(f"req-{i}", prompt, output, float(t)) for i, (prompt, output, t) in enumerate(zip(prompts, outputs, arrivals))]


def arrival_times(num: int, rate: float, rng: np.random.Generator) -> np.ndarray:
    """Poisson arrivals (exponential gaps, first at time 0 + one gap) or all at time 0."""
    if math.isinf(rate):
        return np.zeros(num)
    if rate <= 0:
        raise ValueError("the arrival rate must be positive (inf: all at once)")
    return np.cumsum(rng.exponential(1.0 / rate, num))


def synthetic_lengths(config: WorkloadConfig, rng: np.random.Generator) -> list[tuple[int, int]]:
    """(prompt, output) token lengths of a synthetic workload's requests, each at least 1."""
    n, kind = config.num_requests, config.kind
    if match := re.fullmatch(r"fastgen-(\d+)-(\d+)", kind):
        config = dataclasses.replace(config, prompt_len=int(match[1]), output_len=int(match[2]), cv=0.3)
        kind = "normal"
    if kind in PRESETS:
        p, o = PRESETS[kind]
        prompts, outputs = rng.uniform(0.9 * p, 1.1 * p, n), rng.uniform(0.9 * o, 1.1 * o, n)
    elif kind == "fixed":
        prompts, outputs = np.full(n, config.prompt_len), np.full(n, config.output_len)
    elif kind == "random":
        r = config.range_ratio
        prompts = rng.uniform(r * config.prompt_len, config.prompt_len, n)
        outputs = rng.uniform(r * config.output_len, config.output_len, n)
    elif kind == "normal":
        prompts = rng.normal(config.prompt_len, config.cv * config.prompt_len, n)
        outputs = rng.normal(config.output_len, config.cv * config.output_len, n)
    else:
        raise ValueError(f"unknown workload {config.kind!r}")
    return [(max(1, round(p)), max(1, round(o))) for p, o in zip(prompts, outputs)]


def _sharegpt(config: WorkloadConfig, rng: np.random.Generator) -> tuple[list[tuple[int, ...]], list[int]]:
    """vLLM's picks (sharegpt.py), counted by encoding: a prompt's ids are its count."""
    if config.path is None:
        raise ValueError("the sharegpt workload needs a path to the dataset JSON")
    pairs = sharegpt_pairs(config.path)
    encode = _encoder(config, rng)
    picker = Picker(len(pairs), config.num_requests, config.seed, config.max_prompt_len, config.max_total_len)
    encoded: dict[int, tuple[int, ...]] = {}
    while chunk := picker.next_chunk():
        for i in chunk:
            encoded[i] = encode(pairs[i][0])
        picker.offer(chunk, [(len(encoded[i]), len(encode(pairs[i][1]))) for i in chunk])
    picks = picker.picks()
    return [encoded[p.index] for p in picks], [p.output_len for p in picks]


def _encoder(config: WorkloadConfig, rng: np.random.Generator):
    if config.token_counts == "whitespace":
        return lambda text: tuple(int(t) for t in rng.integers(0, SYNTHETIC_VOCAB, round(len(text.split()) * WORDS_TO_TOKENS)))
    if config.token_counts != "tokenizer":
        raise ValueError("token_counts is 'tokenizer' or 'whitespace'")
    from tokenizers import Tokenizer

    if config.tokenizer_path is not None:
        tokenizer = Tokenizer.from_file(config.tokenizer_path)
    else:
        tokenizer = _tiny_tokenizer()
    return lambda text: tuple(tokenizer.encode(text).ids)


@functools.lru_cache(maxsize=1)
def _tiny_tokenizer():
    """The tiny model's tokenizer.json is this, trained deterministically from the embedded
    corpus (the same ids, special tokens aside); training here spares importing torch."""
    from conveyor.tiny.tokenizer import train_tokenizer

    return train_tokenizer()
