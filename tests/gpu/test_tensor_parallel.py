"""Tensor parallelism on CPU with gloo: the sharded model against the whole one, rank by rank.

`cut` is checked on its own (even splits, replicated KV heads, fused parts, a padded vocabulary).
Then 2 and 4 spawned ranks load each tiny checkpoint sharded (every family: biases on a
row-parallel o_proj and down_proj, tied embeddings, q/k norms, soft-caps, Phi-3's fused
projections, Mixtral's and Qwen2-MoE's experts with a shared one, and a vocabulary that 4 ranks
do not divide), and rank 0's logits must equal one process's unsharded model, which
tests/gpu/test_gpu_model.py holds against transformers. With 4 ranks the checkpoints' 2 KV heads are
replicated. Greedy decoding through ModelRunner (chunked prompts, a preempted sequence) on every
rank must give the unsharded runner's tokens: rank 0 samples, the others take its ids, and a
rank whose inputs drifted would change rank 0's logits at once. Last, the rendezvous: a restarted
engine's ranks never meet through the store its dead predecessor left.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import multiprocessing
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conveyor.config import CacheConfig, EngineConfig, ParallelConfig
from conveyor.gpu.backends import torch_backend
from conveyor.gpu.loading.loader import load_model
from conveyor.gpu.models.registry import read_model_config
from conveyor.gpu.parallel import rendezvous
from conveyor.gpu.parallel.group import SINGLE, TensorParallel
from conveyor.gpu.parallel.shard import Split, cut, shard_model_config
from conveyor.gpu.step.runner import ModelRunner
from tests import gpu_checkpoints, moe_checkpoints
from tests.gpu.test_gpu_model import drive_greedy, forward_prompts, random_prompts

DENSE = ("llama", "qwen2", "qwen3", "gemma2", "phi3")
MOE = ("mixtral", "qwen2_moe")
PROMPT_LENGTHS = [9, 1, 23]
NUM_NEW = 6


def test_cut_splits_evenly_replicates_and_pads():
    full = torch.arange(24).reshape(12, 2)  # 12 rows: 3 heads of 4 rows, or 6 of 2
    assert cut(full, Split(0, ((6, 2),)), 1, 2).tolist() == full[6:].tolist()
    # 2 heads over 4 ranks: ranks 0, 1 hold head 0, ranks 2, 3 head 1.
    heads = [cut(full, Split(0, ((2, 6),)), r, 4) for r in range(4)]
    assert [h[0, 0].item() for h in heads] == [0, 0, 12, 12]
    # Fused parts, each cut on its own: q (2 heads of 2 rows), then k and v (1 head each, replicated).
    fused = cut(full[:8], Split(0, ((2, 2), (1, 2), (1, 2))), 1, 2)
    assert fused[:, 0].tolist() == [4, 6, 8, 10, 12, 14]
    # A row-parallel weight is cut along its input columns.
    assert cut(full.T, Split(1, ((12, 1),)), 2, 3).tolist() == full.T[:, 8:].tolist()
    # 5 vocabulary rows over 2 ranks: 3 each, the last one zero padding.
    vocab = torch.arange(1, 6).reshape(5, 1).float()
    assert cut(vocab, Split(0, ((5, 1),), pad=True), 1, 2).flatten().tolist() == [4.0, 5.0, 0.0]
    assert Split(0, ((5, 1),), pad=True).local_size(2) == 3


def test_shard_model_config_gives_the_backend_the_ranks_kv_heads():
    config = read_model_config(gpu_checkpoints.checkpoint("llama"))
    assert (config.num_heads, config.num_kv_heads) == (4, 2)
    assert shard_model_config(config, 2).num_kv_heads == 1 and shard_model_config(config, 4).num_kv_heads == 1
    assert shard_model_config(config, 4).num_heads == 1 and shard_model_config(config, 1) is config


def padded_vocab_checkpoint(root: Path) -> Path:
    """Qwen2 (tied embeddings) cut to a 509-token vocabulary, which neither 2 nor 4 divides."""
    source = gpu_checkpoints.checkpoint("qwen2")
    root.mkdir(parents=True, exist_ok=True)
    tensors = load_file(source / "model.safetensors")
    tensors = {k: (v[:509].contiguous() if "embed_tokens" in k or "lm_head" in k else v) for k, v in tensors.items()}
    save_file(tensors, root / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    (root / "config.json").write_text(json.dumps({**config, "vocab_size": 509}))
    return root


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    paths = {name: gpu_checkpoints.checkpoint(name) for name in DENSE}
    paths |= {name: moe_checkpoints.checkpoint(name) for name in MOE}
    paths["qwen2_vocab509"] = padded_vocab_checkpoint(tmp_path_factory.mktemp("tp") / "qwen2_vocab509")
    return {name: str(path) for name, path in paths.items()}


def run_checkpoints(tp: TensorParallel, checkpoints: dict[str, str]) -> dict[str, object]:
    """Each checkpoint's prompt logits (rank 0: [T, V]) and greedy outputs, on rank tp.rank."""
    results: dict[str, object] = {}
    for name, path in checkpoints.items():
        config = read_model_config(path)
        backend = dataclasses.replace(torch_backend(shard_model_config(config, tp.size), "cpu"), tp=tp)
        model = load_model(config, "cpu", backend)
        prompts = random_prompts(PROMPT_LENGTHS, seed=3)
        prompts = [[t % config.vocab_size for t in p] for p in prompts]
        results[name] = forward_prompts(model, config, prompts)
        engine = EngineConfig(model=config, cache=CacheConfig(block_size=4, num_kv_blocks=64), parallel=ParallelConfig(device="cpu"))
        runner = ModelRunner(engine, tp=tp)
        runner.initialize_cache(runner.num_available_blocks())
        results[f"{name} greedy"] = drive_greedy(runner, prompts, NUM_NEW, chunk=5, join_at=[0, 1, 2], preempt={4: 0})
    return results


def _rank_main(rank: int, size: int, store: str, checkpoints: dict[str, str], out: str) -> None:
    with gloo_rank(rank, size, store) as tp:
        results = run_checkpoints(tp, checkpoints)
        if rank == 0:
            torch.save(results, out)
        else:  # the ranks that do not sample compute no logits
            assert all(results[name].shape[-1] == 0 for name in checkpoints)  # type: ignore[attr-defined]


@contextlib.contextmanager
def gloo_rank(rank: int, size: int, store: str) -> Iterator[TensorParallel]:
    """This (forked) process as rank `rank` of a gloo group of `size` meeting at the file `store`,
    on one thread, the group torn down on the way out."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=size)
    try:
        yield TensorParallel(rank, size, torch.distributed.group.WORLD)
    finally:
        torch.distributed.destroy_process_group()


def rank_runners(tp: TensorParallel) -> contextlib.AbstractContextManager:
    """Within it, an LLM runs this rank's ModelRunner (the offline API has no ranks of its own);
    each rank's scheduler sees the same requests and so sends its runner the same plans."""
    from unittest import mock

    from conveyor.gpu.step import runner as runner_module

    return mock.patch.object(runner_module, "ModelRunner", functools.partial(runner_module.ModelRunner, tp=tp))


def run_forked(target, rank_args: list[tuple], timeout: float) -> None:
    """One forked process per rank, `target(*rank_args[r])`, each exiting 0 within `timeout` s
    (fork: the ranks inherit the imports; spawn would re-import transformers in each)."""
    ctx = multiprocessing.get_context("fork")
    ranks = [ctx.Process(target=target, args=args) for args in rank_args]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join(timeout)
    codes = [p.exitcode for p in ranks]
    for p in ranks:
        if p.is_alive():
            p.kill()
    assert codes == [0] * len(ranks), f"rank exit codes {codes}"


def run_ranks(size: int, checkpoints: dict[str, str], tmp: Path) -> dict[str, object]:
    out = tmp / f"tp{size}.pt"
    run_forked(_rank_main, [(r, size, str(tmp / f"store{size}"), checkpoints, str(out)) for r in range(size)], 240)
    return torch.load(out)


@pytest.fixture(scope="module")
def whole(checkpoints) -> dict[str, object]:
    return run_checkpoints(SINGLE, checkpoints)


# 4 ranks on two cores are slow: the families whose split differs at 4 (KV heads replicated, a
# padded vocabulary, fused parts, a shared expert); 2 ranks run every checkpoint.
ON_FOUR = ("llama", "phi3", "qwen2_moe", "qwen2_vocab509")


@pytest.mark.parametrize("size", [2, 4])
def test_sharded_models_equal_the_whole_model(size, checkpoints, whole, tmp_path):
    names = [name for name in checkpoints if size == 2 or name in ON_FOUR]
    sharded = run_ranks(size, {name: checkpoints[name] for name in names}, tmp_path)
    for name in names:
        ours, ref = sharded[name], whole[name]
        assert isinstance(ours, torch.Tensor) and isinstance(ref, torch.Tensor)
        assert ours.shape == ref.shape, name
        torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4, msg=lambda m, name=name: f"{name}: {m}")
        assert sharded[f"{name} greedy"] == whole[f"{name} greedy"], name


def test_a_restarted_engine_never_meets_its_dead_predecessors_store(tmp_path):
    """The link a dead rank 0 left names a pid that is gone: a follower waits for the new rank 0,
    which clears the old store and points the link at its own."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / f"tp-engine-0-{dead.pid}.store").write_text("stale keys")
    os.symlink(f"tp-engine-0-{dead.pid}.store", tmp_path / "tp-engine-0")
    found: list[str] = []
    follower = threading.Thread(target=lambda: found.append(rendezvous._file_store(tmp_path, 0, 1)))
    follower.start()
    follower.join(0.5)
    assert follower.is_alive() and not found  # the old link's pid is dead: not followed
    method = rendezvous._file_store(tmp_path, 0, 0)
    follower.join(10)
    assert found == [method] == [f"file://{tmp_path}/tp-engine-0-{os.getpid()}.store"]
    assert not (tmp_path / f"tp-engine-0-{dead.pid}.store").exists()
