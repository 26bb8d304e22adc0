"""The backend seam (gpu/backends): which backend `select` builds, that the CPU path never imports
triton, that the model runs the same on the torch and cpu backends, and that the CUDA KV sizing
profile (gpu/step/profile_steps.py) covers the worst steps the scheduler can plan."""

from __future__ import annotations

import dataclasses
import logging
import subprocess
import sys

import pytest
import torch

from conveyor.config.engine import ParallelConfig, SchedulerConfig
from conveyor.config.model import ModelConfig
from conveyor.gpu.backends import select
from conveyor.gpu.backends.cpu import CpuAttention, CpuOps
from conveyor.gpu.backends.cpu.kernels import paged_attention_kernel
from conveyor.gpu.backends.torch import TorchAttention, TorchOps
from conveyor.gpu.models.registry import read_model_config
from conveyor.gpu.step import profile_steps as profile_module
from conveyor.gpu.step.profile_steps import profile_run, profile_steps
from conveyor.gpu.step.runner import ModelRunner
from tests.gpu.test_gpu_model import drive_greedy, random_prompts
from tests.gpu_checkpoints import checkpoint, engine_config

CPU = torch.device("cpu")
needs_kernel = pytest.mark.skipif(paged_attention_kernel() is None, reason="no C++ compiler for the CPU kernels")


def model_config(dtype: str | None = None) -> ModelConfig:
    return read_model_config(checkpoint("llama"), dtype=dtype)


@needs_kernel
def test_auto_on_a_cpu_is_the_cpu_backend():
    backend = select("auto", "cpu", model_config())
    assert backend.name == "cpu" and backend.description.startswith("cpu (C++ paged attention, fused ops")
    assert isinstance(backend.attn, CpuAttention) and isinstance(backend.ops, CpuOps)


@needs_kernel
@pytest.mark.parametrize(
    ("env", "warned"),
    [({"OMP_PROC_BIND": "close"}, True), ({"OMP_PLACES": "cores"}, True), ({"OMP_PROC_BIND": "false"}, False), ({}, False)],
)
def test_bound_openmp_threads_are_warned_of(env, warned, monkeypatch, caplog):
    for name in ("OMP_PROC_BIND", "OMP_PLACES"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with caplog.at_level(logging.WARNING, logger="conveyor.gpu.backends.cpu"):
        assert select("cpu", CPU, model_config()).name == "cpu"
    assert ("binds OpenMP threads" in caplog.text) == warned


def test_torch_is_the_reference_anywhere():
    backend = select("torch", CPU, model_config("bfloat16"))
    assert backend.name == "torch" and isinstance(backend.attn, TorchAttention) and type(backend.ops) is TorchOps


@pytest.mark.parametrize("name", ["auto", "cpu"])
def test_cpu_falls_back_to_torch_with_a_warning_where_it_cannot_run(name, caplog):
    with caplog.at_level(logging.WARNING, logger="conveyor.gpu.backends"):
        backend = select(name, CPU, model_config("bfloat16"))  # the C++ kernels take float32 only
    assert backend.name == "torch"
    assert "cpu backend cannot run here" in caplog.text and "bfloat16" in caplog.text


def test_an_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="unknown backend"):
        select("cuda-graphs", CPU, model_config())


def test_the_cpu_path_never_imports_the_triton_backend():
    # Not `'triton' in sys.modules`: torch itself imports triton where it is installed.
    script = (
        "import sys\n"
        "from conveyor.engine_config import build_engine_config\n"
        "from conveyor.gpu.step.runner import ModelRunner\n"
        "ModelRunner(build_engine_config('tiny', device='cpu', num_kv_blocks=8)).initialize_cache(8)\n"
        "print('conveyor.gpu.backends.triton' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False"]


def test_the_runner_logs_its_backend_once(caplog):
    with caplog.at_level(logging.INFO, logger="conveyor.gpu.step.runner"):
        ModelRunner(engine_config("qwen2"))
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("attention backend: ")]
    assert len(lines) == 1


@needs_kernel
def test_greedy_output_is_the_same_on_the_torch_and_cpu_backends():
    prompts = random_prompts([5, 19, 33], seed=7)
    outputs = []
    for name in ("torch", "cpu"):
        config = engine_config("llama")
        config = dataclasses.replace(config, parallel=ParallelConfig(attention_backend=name))
        runner = ModelRunner(config)
        assert runner.backend.name == name
        runner.initialize_cache(runner.num_available_blocks())
        outputs.append(drive_greedy(runner, prompts, max_new=8, join_at=[0, 1, 3]))
    assert outputs[0] == outputs[1]


def test_profile_steps_cover_the_worst_plannable_steps():
    steps = {s.name: s for s in profile_steps(max_num_batched_tokens=512, max_num_seqs=64, max_model_len=300, block_size=16)}
    prefill, decode, chunk = steps["prefill"], steps["decode"], steps["chunk after cached prefix"]
    assert prefill.query_lens == prefill.seq_lens == [300, 212]  # the budget as fresh prompts
    assert decode.query_lens == [1] * 64 and decode.seq_lens == [300] * 64  # decode rows at the longest context
    assert chunk.query_lens == [299] and chunk.seq_lens == [300]  # a chunk after a cached prefix
    for step in steps.values():
        for seq_len, table in zip(step.seq_lens, step.block_tables):
            assert len(table) * 16 >= seq_len
    # A budget below the context: the chunk is the whole budget, after a long prefix.
    (_, _, short) = profile_steps(max_num_batched_tokens=128, max_num_seqs=256, max_model_len=4096, block_size=16)
    assert short.query_lens == [128] and short.seq_lens == [4096]


def test_the_profile_run_executes_those_steps(monkeypatch):
    config = engine_config("mistral")
    config = dataclasses.replace(config, scheduler=SchedulerConfig(max_num_batched_tokens=96, max_num_seqs=12))
    runner = ModelRunner(config)
    seen = []
    build = profile_module.first_pass_inputs

    def spy(rows, *args):
        seen.append(([r.end - r.start for r in rows], [r.end for r in rows]))
        return build(rows, *args)

    monkeypatch.setattr(profile_module, "first_pass_inputs", spy)
    profile_run(runner)  # CUDA-only in the worker; the same steps run on a CPU here
    longest = config.model.max_model_len
    expected = profile_steps(96, 12, longest, config.cache.block_size)
    assert seen == [(s.query_lens, s.seq_lens) for s in expected]
    assert ([1] * 12, [longest] * 12) in seen
    assert ([min(96, longest - 1)], [longest]) in seen
    assert runner.kv_caches == [] and runner.num_blocks == 0  # the scratch cache is gone
