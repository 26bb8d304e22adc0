"""gpu/step/cuda_graphs.py: bucket choice, the static buffers' padding, and decode steps through them.

On a CPU (no capture: `run` calls the model eagerly over the same static buffers and padding),
the tiny Llama of tests/gpu_checkpoints.py runs on the triton backend under Triton's interpreter
(tests/conftest.py sets TRITON_INTERPRET=1): every step's hidden states must equal the plain
eager forward's over the same rows, and padding rows may write no KV but the scratch block's.
The GPU tests capture every bucket and check each replay against the eager forward.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from conveyor.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig
from conveyor.config.lora import LoraConfig
from conveyor.gpu.backends import select, torch_backend
from conveyor.gpu.backends.base import AttentionMetadata
from conveyor.gpu.loading.loader import load_model
from conveyor.gpu.lora.slots import LoraSlots
from conveyor.gpu.models.registry import read_model_config
from conveyor.gpu.parallel.group import SINGLE
from conveyor.gpu.step.cuda_graphs import DecodeGraphs, bucket_sizes, buckets_for, can_capture
from conveyor.tiny.lora import make_random_adapter
from conveyor.wire.step import LoraLoad
from tests.gpu_checkpoints import VOCAB, checkpoint

pytest.importorskip("triton")

BLOCK_SIZE = 4
NUM_BLOCKS = 128  # enough for 24 rows of up to 5 blocks each
SCRATCH = 0  # the padding rows' block; the steps below take their blocks from the others
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}  # as tests/kernels/test_triton_attention.py


def config_for(*, cap: int = 256, max_num_seqs: int = 256, eager: bool = False, device: str = "cpu", dtype: str | None = None):
    return EngineConfig(
        model=read_model_config(checkpoint("llama"), max_model_len=32, dtype=dtype),
        cache=CacheConfig(block_size=BLOCK_SIZE, num_kv_blocks=NUM_BLOCKS),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs),
        parallel=ParallelConfig(device=device, enforce_eager=eager, max_cuda_graph_batch_size=cap, attention_backend="triton"),
    )


@pytest.fixture(scope="module")
def config() -> EngineConfig:
    return config_for()


def triton_attn(config: EngineConfig, device: str = "cpu"):
    return select("triton", device, config.model).attn


class Recorder:
    """A stand-in model: records what each call saw, returns [T, 1] = input_id * 100 + position."""

    def __init__(self) -> None:
        self.calls: list[tuple[torch.Tensor, torch.Tensor, AttentionMetadata]] = []

    def __call__(self, input_ids, positions, meta, kv_caches):
        self.calls.append((input_ids.clone(), positions.clone(), meta))
        return (input_ids * 100 + positions).float()[:, None]


def graphs_on_cpu(model, attn, kv, buckets: list[int], *, scratch_block: int = SCRATCH, capture: bool = False) -> DecodeGraphs:
    """DecodeGraphs over `kv` on the CPU device, tables 8 blocks wide, no sliding window."""
    return DecodeGraphs(
        model,
        attn,
        kv,
        buckets=buckets,
        max_blocks_per_seq=8,
        block_size=BLOCK_SIZE,
        sliding_window=None,
        scratch_block=scratch_block,
        device=torch.device("cpu"),
        capture=capture,
    )


def recorded_graphs(config: EngineConfig, buckets: list[int]) -> tuple[DecodeGraphs, Recorder]:
    attn = triton_attn(config)
    model = Recorder()
    kv = attn.allocate_kv_caches(NUM_BLOCKS, BLOCK_SIZE)
    graphs = graphs_on_cpu(model, attn, kv, buckets)
    return graphs, model


def decode_step(num_rows: int, seed: int, device: str = "cpu"):
    """A decode step of `num_rows` rows with distinct blocks (never SCRATCH): input_ids,
    positions [B] int64, block_tables [B, W] int32, seq_lens [B] int32, on `device`."""
    rng = random.Random(seed)
    pool = list(range(1, NUM_BLOCKS))
    rng.shuffle(pool)
    seq_lens = [rng.randint(1, 20) for _ in range(num_rows)]
    width = max(-(-n // BLOCK_SIZE) for n in seq_lens)
    tables = torch.zeros(num_rows, width, dtype=torch.int32)
    for row, n in enumerate(seq_lens):
        tables[row, : -(-n // BLOCK_SIZE)] = torch.tensor([pool.pop() for _ in range(-(-n // BLOCK_SIZE))])
    input_ids = torch.tensor([rng.randrange(VOCAB) for _ in range(num_rows)])
    positions = torch.tensor(seq_lens) - 1
    return input_ids.to(device), positions.to(device), tables.to(device), torch.tensor(seq_lens, dtype=torch.int32, device=device)


@pytest.mark.parametrize(
    "limit, expected",
    [
        (1, [1]),
        (3, [1, 2, 3]),
        (8, [1, 2, 4, 8]),
        (20, [1, 2, 4, 8, 16, 20]),
        (256, [1, 2, 4, *range(8, 257, 8)]),
    ],
)
def test_bucket_sizes(limit, expected):
    assert bucket_sizes(limit) == expected


@pytest.mark.parametrize("cap, max_num_seqs, largest", [(256, 256, 256), (256, 20, 20), (12, 256, 12), (5, 3, 3)])
def test_buckets_stop_at_the_cap_or_max_num_seqs(cap, max_num_seqs, largest):
    buckets = buckets_for(config_for(cap=cap, max_num_seqs=max_num_seqs))
    assert buckets[-1] == largest and buckets == bucket_sizes(largest)


def test_bucket_for_rounds_up_and_gives_up_past_the_largest(config):
    graphs, _ = recorded_graphs(config, [1, 2, 4, 8, 16, 20])
    choices = {n: graphs.bucket_for(n) for n in (0, 1, 2, 3, 4, 5, 8, 9, 16, 17, 20, 21, 300)}
    assert choices == {0: None, 1: 1, 2: 2, 3: 4, 4: 4, 5: 8, 8: 8, 9: 16, 16: 16, 17: 20, 20: 20, 21: None, 300: None}
    with pytest.raises(ValueError, match="no decode graph for 21 rows"):
        graphs.run(*decode_step(21, seed=0))


def test_padding_rows_decode_token_0_at_position_0_in_the_scratch_block(config):
    graphs, model = recorded_graphs(config, [1, 2, 4, 8])
    graphs.run(*decode_step(8, seed=1))  # leaves real rows in all 8 places: the next step must pad over them
    input_ids, positions, tables, seq_lens = decode_step(3, seed=2)
    hidden = graphs.run(input_ids, positions, tables, seq_lens)

    assert hidden.shape == (3, 1)
    assert hidden[:, 0].tolist() == (input_ids * 100 + positions).float().tolist()
    seen_ids, seen_positions, meta = model.calls[-1]
    b = graphs.buffers
    assert seen_ids.tolist() == [*input_ids.tolist(), 0] and seen_positions.tolist() == [*positions.tolist(), 0]
    assert b.seq_lens[:4].tolist() == [*seq_lens.tolist(), 1]
    width = tables.shape[1]
    assert torch.equal(b.block_tables[:3, :width], tables)
    assert (b.block_tables[:3, width:] == SCRATCH).all() and (b.block_tables[3] == SCRATCH).all()
    slots = [int(tables[r, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE for r, p in enumerate(positions.tolist())]
    assert b.slot_mapping[:4].tolist() == [*slots, SCRATCH * BLOCK_SIZE]
    # The metadata is the bucket's, over views of the static buffers: nothing rebuilt per step.
    assert meta.num_tokens == 4 and meta.max_query_len == 1 and meta.max_seq_len == 8 * BLOCK_SIZE
    assert meta.query_start_loc.tolist() == [0, 1, 2, 3, 4] and meta.query_lens.tolist() == [1] * 4
    for field, buffer in [("seq_lens", b.seq_lens), ("block_tables", b.block_tables), ("slot_mapping", b.slot_mapping)]:
        assert getattr(meta, field).data_ptr() == buffer.data_ptr(), field
    graphs.run(*decode_step(4, seed=3))
    assert model.calls[-1][2] is meta


@pytest.fixture(scope="module")
def tiny_model(config):
    backend = select("triton", "cpu", config.model)
    return load_model(config.model, "cpu", backend), backend.attn


@pytest.mark.parametrize("num_rows", [1, 3, 8])
def test_run_equals_the_eager_forward_and_padding_writes_only_the_scratch_block(tiny_model, num_rows):
    model, attn = tiny_model
    gen = torch.Generator().manual_seed(num_rows)
    kv = [torch.randn(cache.shape, generator=gen) for cache in attn.allocate_kv_caches(NUM_BLOCKS, BLOCK_SIZE)]
    eager_kv, graph_kv = [c.clone() for c in kv], [c.clone() for c in kv]
    input_ids, positions, tables, seq_lens = decode_step(num_rows, seed=num_rows)

    meta = attn.build_metadata([1] * num_rows, seq_lens.tolist(), tables, positions, BLOCK_SIZE, None)
    with torch.inference_mode():
        want = model(input_ids, positions, meta, eager_kv)
    graphs = graphs_on_cpu(model, attn, graph_kv, [1, 4, 10])
    got = graphs.run(input_ids, positions, tables, seq_lens)

    assert got.shape == want.shape == (num_rows, config_for().model.hidden_size)
    torch.testing.assert_close(got, want, atol=TOLERANCE[torch.float32], rtol=TOLERANCE[torch.float32])
    padded = graphs.bucket_for(num_rows) != num_rows
    for before, eager, after in zip(kv, eager_kv, graph_kv):
        # Real rows wrote what the eager step wrote; outside the scratch block nothing else changed.
        torch.testing.assert_close(after[:, 1:], eager[:, 1:], atol=1e-5, rtol=1e-5)
        changed = (after[:, SCRATCH] != before[:, SCRATCH]).flatten(2).any(-1)  # [2, block_size]
        assert changed[:, 1:].sum() == 0  # pad rows sit at position 0: offset 0 only
        assert bool(changed[:, 0].all()) == padded


def test_the_triton_and_cpu_backends_support_graphs(config):
    from conveyor.gpu.backends.cpu import CpuAttention

    assert triton_attn(config).supports_decode_graphs
    assert CpuAttention.supports_decode_graphs  # recorded, not captured: tests/gpu/test_cpu_decode_programs.py
    torch_attn = torch_backend(config.model, "cpu").attn
    assert not torch_attn.supports_decode_graphs
    assert not can_capture(config, torch_attn, torch.device("cuda"))
    kv = torch_attn.allocate_kv_caches(2, BLOCK_SIZE)
    with pytest.raises(ValueError, match="cannot be captured"):
        graphs_on_cpu(Recorder(), torch_attn, kv, [1], scratch_block=0)


def test_capture_only_on_cuda_without_enforce_eager(config):
    attn, cuda = triton_attn(config), torch.device("cuda")
    assert can_capture(config, attn, cuda)
    assert not can_capture(config_for(eager=True), attn, cuda)
    assert not can_capture(config, attn, torch.device("cpu"))
    kv = attn.allocate_kv_caches(2, BLOCK_SIZE)
    graphs = DecodeGraphs.from_config(config, Recorder(), attn, kv, scratch_block=1, device=torch.device("cpu"))
    assert not graphs.capture and graphs.buckets == buckets_for(config)
    assert graphs.capture_all() == (0.0, 0)
    assert graphs.buffers.block_tables.shape == (256, 8)  # ceil(max_model_len 32 / block size 4)
    with pytest.raises(ValueError, match="need a CUDA device"):
        graphs_on_cpu(Recorder(), attn, kv, [1], scratch_block=0, capture=True)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype,kv_dtype", [(torch.float32, None), (torch.bfloat16, None), (torch.bfloat16, "float8_e4m3fn")])
def test_every_captured_bucket_replays_the_eager_forward(dtype, kv_dtype):
    """Capture every bucket of max_num_seqs 24 (1, 2, 4, 8, 16, 24) behind a memory probe that
    shares its pool, then replay each with a full and a padded step against the eager forward
    (the last case with an fp8 KV cache: its quantizing write and e4m3 reads are captured too)."""
    device = torch.device("cuda")
    config = config_for(max_num_seqs=24, device="cuda", dtype=str(dtype).removeprefix("torch."))
    backend = select("triton", device, config.model, kv_dtype)
    model, attn = load_model(config.model, device, backend), backend.attn
    probe = DecodeGraphs.memory_probe(config, model, attn, device)
    _, probe_bytes = probe.capture_all()
    assert probe_bytes > 0
    gen = torch.Generator().manual_seed(0)
    kv = [torch.randn(c.shape, generator=gen).to(device, c.dtype) for c in attn.allocate_kv_caches(NUM_BLOCKS, BLOCK_SIZE)]
    graphs = DecodeGraphs.from_config(config, model, attn, kv, scratch_block=SCRATCH, device=device, pool=probe.pool)
    assert graphs.capture and graphs.buckets == [1, 2, 4, 8, 16, 24]
    graphs.capture_all()
    del probe
    tol = TOLERANCE[dtype] if dtype != torch.float32 else 1e-4  # split-K may differ with the table's width
    for bucket in graphs.buckets:
        for num_rows in sorted({bucket, max(1, bucket - 1)}):
            step = decode_step(num_rows, seed=bucket * 100 + num_rows, device="cuda")
            input_ids, positions, tables, seq_lens = step
            eager_kv = [c.clone() for c in kv]
            meta = attn.build_metadata([1] * num_rows, seq_lens.tolist(), tables, positions, BLOCK_SIZE, None)
            with torch.inference_mode():
                want = model(input_ids, positions, meta, eager_kv).float()
            got = graphs.run(*step).float()
            torch.testing.assert_close(got, want, atol=tol, rtol=tol, msg=f"bucket {bucket}, {num_rows} rows")
            for graph_cache, eager_cache in zip(kv, eager_kv):
                torch.testing.assert_close(graph_cache[:, 1:].float(), eager_cache[:, 1:].float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("kernel", ["bgmv", "sgmv"])
def test_lora_rows_read_the_graphs_static_slots(tiny_model, config, tmp_path, monkeypatch, kernel):
    """A decode step through the graphs' buffers with LoRA rows (some on the base, one padding row
    past them) equals the eager step: the projections read the static slots the pass wrote (sgmv:
    grouped by slot inside the graph, triton/lora_groups.py)."""
    from conveyor.gpu.backends.triton import lora_groups

    monkeypatch.setattr(lora_groups, "KERNEL_BY_ROWS", ((1, kernel),))
    model, attn = tiny_model
    lora_config = dataclasses.replace(config, lora=LoraConfig(enable_lora=True, max_loras=2, max_lora_rank=8))
    adapter = make_random_adapter(checkpoint("llama"), tmp_path / "adapter", rank=8, seed=3)
    slots = LoraSlots(model, lora_config, select("triton", "cpu", config.model).ops, SINGLE, torch.device("cpu"))
    try:
        slots.load(LoraLoad(1, "a", str(adapter)))
        kv = attn.allocate_kv_caches(NUM_BLOCKS, BLOCK_SIZE)
        input_ids, positions, tables, seq_lens = decode_step(3, seed=7)
        token_slots = [1, -1, 1]
        meta = attn.build_metadata([1] * 3, seq_lens.tolist(), tables, positions, BLOCK_SIZE, None)
        with torch.inference_mode():
            slots.begin_pass(token_slots)
            want = model(input_ids, positions, meta, [c.clone() for c in kv])
            slots.begin_pass([-1, -1, -1])
            base = model(input_ids, positions, meta, [c.clone() for c in kv])
            graphs = graphs_on_cpu(slots.graph_model(model), attn, [c.clone() for c in kv], [4])
            slots.begin_pass(token_slots, graphed=True)
            got = graphs.run(input_ids, positions, tables, seq_lens)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert not torch.allclose(want[0], base[0]) and torch.allclose(
            want[1], base[1], atol=1e-5
        )  # the adapter acts on its rows only
        assert slots.graph_slots[:4].tolist() == [1, -1, 1, -1]  # the padding row reads no adapter
    finally:
        for projection in slots.projections.values():
            projection.layer.lora = None  # the module's model is shared with the other tests
