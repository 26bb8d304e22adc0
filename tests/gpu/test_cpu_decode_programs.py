"""Decode graphs on the CPU (gpu/step/cuda_graphs.py over Ops.record: the cpu ops' recorded
kernel programs): every bucket's replay equals the eager forward over the same rows and writes
the same KV, float and quantized; and an engine's greedy tokens are the same with programs as with --enforce-eager.

The programs themselves (replay, refusals) are tested in tests/kernels/test_cpu_kernel_program.py.
"""

from __future__ import annotations

import pytest
import torch

from conveyor import LLM, SamplingParams
from conveyor.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig
from conveyor.gpu.backends import select
from conveyor.gpu.backends.cpu.kernels import program
from conveyor.gpu.loading.loader import load_model
from conveyor.gpu.models.registry import read_model_config
from conveyor.gpu.step.cuda_graphs import CPU_MAX_BUCKET, DecodeGraphs
from conveyor.tiny.checkpoint import make_checkpoint
from tests.gpu.test_cuda_graphs import BLOCK_SIZE, NUM_BLOCKS, SCRATCH, decode_step
from tests.gpu_checkpoints import checkpoint

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(not program.available(), reason="no C++ compiler for the CPU kernels")


def config_for(max_num_seqs: int = 24) -> EngineConfig:
    return EngineConfig(
        model=read_model_config(checkpoint("llama"), max_model_len=32),
        cache=CacheConfig(block_size=BLOCK_SIZE, num_kv_blocks=NUM_BLOCKS),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs),
        parallel=ParallelConfig(device="cpu"),
    )


@pytest.mark.parametrize("quantized", [False, True], ids=["float", "u4 weights"])
def test_every_recorded_bucket_replays_the_eager_forward(quantized):
    """Every size to max_num_seqs 12 (below CPU_MAX_BUCKET: the CPU records each size, so no step
    is padded), each run three times on new rows (eagerly, recorded as it runs, replayed) against
    the eager forward on a copy of the cache."""
    config = config_for(max_num_seqs=12)
    backend = select("cpu", CPU, config.model)
    model, attn = load_model(config.model, CPU, backend), backend.attn
    if quantized:
        quantize_projections(model, backend)
    gen = torch.Generator().manual_seed(0)
    kv = [torch.randn(c.shape, generator=gen) for c in attn.allocate_kv_caches(NUM_BLOCKS, BLOCK_SIZE)]
    graphs = DecodeGraphs.from_config(config, model, attn, kv, scratch_block=SCRATCH, device=CPU, record=backend.ops.record)
    assert graphs.buckets == list(range(1, 13)) and CPU_MAX_BUCKET >= 12
    assert graphs.capture_all() == (0.0, 0)  # recorded as steps come, not at start-up
    for bucket in graphs.buckets:
        for seed in (bucket, bucket + 100, bucket + 200):
            input_ids, positions, tables, seq_lens = decode_step(bucket, seed=seed)
            eager_kv = [c.clone() for c in kv]
            meta = attn.build_metadata([1] * bucket, seq_lens.tolist(), tables, positions, BLOCK_SIZE, None)
            with torch.inference_mode():
                want = model(input_ids, positions, meta, eager_kv)
            got = graphs.run(input_ids, positions, tables, seq_lens)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=f"{bucket} rows")
            for cache, eager_cache in zip(kv, eager_kv):
                torch.testing.assert_close(cache, eager_cache, atol=1e-6, rtol=1e-6)  # the same KV written
    assert sorted(graphs._replays) == graphs.buckets


def quantize_projections(model, backend) -> None:
    """Each projection's weight as u4 codes in groups of 32 with mins (Q4_1's form), read packed
    by the cpu quant kernel's int8 path."""
    from conveyor.gpu.quant.weight import quantize_groups

    for name, module in model.named_modules():
        if name.endswith("proj") and getattr(module, "weight", None) is not None:
            module.quantized = quantize_groups(module.weight.data.contiguous(), "u4", 32)  # prepare left it [in, out]
            module.weight = None
    backend.ops.prepare(model)


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> str:
    """A tiny Qwen2 checkpoint with its tokenizer (tests/gpu/test_quant_online.py's shape)."""
    sizes = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    return str(make_checkpoint(tmp_path_factory.mktemp("programs") / "hf", "Qwen2ForCausalLM", seed=7, **sizes))


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_greedy_tokens_equal_with_programs_and_enforce_eager(served, quantization):
    """Through the engine (prefill, decode steps of 4 rows, then 3, 2 and 1 as prompts finish, the
    last alone for 6 steps: eager, recorded, then replayed): the same tokens."""
    prompts = ["Hello, my name is", "The quick brown fox", "a", "one two three four five six"]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (16, 7, 10, 3)]
    kwargs = dict(device="cpu", num_kv_blocks=64, quantization=quantization)
    programs = LLM(served, **kwargs)
    graphs = programs.runner.graphs
    assert graphs is not None
    ours = [o.outputs[0].token_ids for o in programs.generate(prompts, params)]
    assert {1, 2} <= set(graphs._replays)
    eager = LLM(served, enforce_eager=True, **kwargs)
    assert eager.runner.graphs is None
    assert ours == [o.outputs[0].token_ids for o in eager.generate(prompts, params)]


def test_a_float_model_with_wide_layers_records(tmp_path):
    """down_proj wider than small_linear takes (1056 inputs) and a head tied to the embedding: the
    row kernel serves their decode rows, so the one-row steps replay a program (torch's GEMM there
    refused the recording), with the tokens of --enforce-eager."""
    sizes = dict(hidden_size=64, intermediate_size=1056, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    path = str(make_checkpoint(tmp_path / "hf", "Qwen2ForCausalLM", seed=3, **sizes))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    programs = LLM(path, device="cpu", num_kv_blocks=32)
    graphs = programs.runner.graphs
    assert graphs is not None
    ours = programs.generate(["Hello, my name is"], params)[0].outputs[0].token_ids
    assert 1 in graphs._replays
    eager = LLM(path, device="cpu", num_kv_blocks=32, enforce_eager=True)
    assert ours == eager.generate(["Hello, my name is"], params)[0].outputs[0].token_ids
