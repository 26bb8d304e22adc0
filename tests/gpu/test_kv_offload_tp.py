"""The KV host tier at tensor-parallel size 2, on CPU with gloo: each rank keeps its own shard of
every block in its own host slots, and applies each plan's saves and loads to it.

Two forked ranks each run an LLM whose runner is that rank of the group (the offline API has no
ranks of its own: the test hands LLM a rank's ModelRunner). Each rank's scheduler sees the same
requests and so makes the same plans, as the daemon's one scheduler sends one plan to every rank;
a plan that differed between ranks would mismatch their collectives. The prefix evicted from the
device comes back from the host tier on both ranks, and rank 0's outputs are the single-rank
engine's without the tier (tests/gpu/test_tensor_parallel.py holds the sharded model to the whole
one).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conveyor import LLM
from conveyor.gpu.step.features.kv_offload import KvOffloadStep
from conveyor.wire.messages import SamplingParams
from tests.gpu.test_kv_offload import POOL, _run
from tests.gpu.test_tensor_parallel import gloo_rank, rank_runners, run_forked

CASES = [  # (params, --max-num-batched-tokens): greedy whole, seeded and forked chunked
    (SamplingParams(temperature=0.0, max_tokens=6), None),
    (SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=6, n=2), 16),
]


def _options(chunk: int | None) -> dict:
    return dict(POOL, max_num_batched_tokens=chunk) if chunk else dict(POOL)


def _rank_main(rank: int, store: str, path: str, out: str) -> None:
    results = []
    with gloo_rank(rank, 2, store) as tp, rank_runners(tp):
        for params, chunk in CASES:
            llm = LLM(path, tensor_parallel_size=2, kv_offloading_size=0.01, **_options(chunk))
            outputs = _run(llm, params)
            tiers, offload = llm.core.scheduler.tiers, llm.runner.feature(KvOffloadStep)
            assert tiers is not None and offload is not None and offload.host is not None
            results.append({"outputs": outputs, "hits": tiers.num_host_hits, "loaded": offload.num_loaded})
    Path(out).write_text(json.dumps(results))


@pytest.fixture(scope="module")
def path(checkpoints):
    return str(checkpoints["LlamaForCausalLM"])  # 2 KV heads: one a rank


def test_a_prefix_back_from_each_ranks_host_tier_gives_the_single_rank_outputs(path, tmp_path):
    # First, as one rank without the tier: this also builds the C++ kernels once, which the
    # forked ranks inherit (each would build them again, at once, in a fresh cache).
    expected = [_run(LLM(path, **_options(chunk)), params) for params, chunk in CASES]
    outs = [tmp_path / f"rank{r}.json" for r in range(2)]
    run_forked(_rank_main, [(r, str(tmp_path / "store"), path, str(outs[r])) for r in range(2)], 120)
    first, second = (json.loads(out.read_text()) for out in outs)
    for case, ours, theirs, single in zip(CASES, first, second, expected):
        assert ours["hits"] >= 9, case  # the prefix's blocks but the one its last token's logits need
        assert ours["loaded"] == theirs["loaded"] >= 9, case  # each rank loaded its own shard of them
        assert ours["outputs"] == theirs["outputs"] == single, case  # the other rank took rank 0's ids
