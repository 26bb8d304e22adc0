"""Decode graphs: one per bucket of rows, replayed over static buffers. On CUDA a captured CUDA
graph; on the CPU the cpu ops' recorded kernel program (Ops.record: gpu/backends/cpu/kernels/program.py).

A decode step launches hundreds of small kernels, and at small batches their launch cost (on
the CPU: the Python around each call), not their work, bounds it. This module owns the buckets
(`buckets_for`), the static inputs every graph reads (`DecodeBuffers`), the captured graphs and
their memory pool, or the recorded programs. A step of B decode rows replays the smallest bucket
>= B; the caller runs a step with a prompt chunk, or with more rows than the largest bucket,
eagerly. The runner's calling order is `DecodeGraphs`' docstring.

Invariants:
- no kernel grid depends on the step: graph b reads views [:b] of the buffers through metadata
  built once (`attn.build_graph_metadata`), and computes the slot mapping inside the graph;
- padding rows, and table columns past a row's width (no kernel reads past seq_len), name only
  `scratch_block`, a KV block no sequence owns: a replay never touches a real sequence's cache;
- captured only where `can_capture` (CUDA, no --enforce-eager, `attn.supports_decode_graphs`);
  recorded on the CPU where the ops can (`record`), bucket by bucket, on its second step: a bucket
  whose forward does work a recording cannot replay (NotRecordable: a torch op) runs eagerly,
  logged once; with neither, the same buffers and padding run eagerly (the emulated device).
"""

from __future__ import annotations

import bisect
import functools
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from conveyor.config.engine import EngineConfig
from conveyor.gpu.backends.base import AttentionBackend, AttentionMetadata
from conveyor.gpu.backends.ops import NotRecordable, Replay

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE

log = logging.getLogger(__name__)

# (input_ids [T], positions [T], meta, kv_caches) -> hidden [T, H]: the model's forward.
DecodeModel = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata, list[torch.Tensor]], torch.Tensor]
# Ops.record: a forward -> (its output, its replay).
Recorder = Callable[[Callable[[], torch.Tensor]], tuple[torch.Tensor, Replay]]

SMALL_BUCKETS = (1, 2, 4, 8)
BUCKET_STEP = 8  # past the small buckets, a bucket every 8 rows: at most 7 padding rows
# On the CPU every row count up to this one is recorded: a padding row costs a CPU about what a
# row does (~1.3 ms a row on SmolLM2, against ~2.9 ms of Python a program saves a step), not the
# nothing it costs a GPU. Past it a step's kernels, not the Python around them, weigh
# (docs/benchmarks/cpu-isa.md).
CPU_MAX_BUCKET = 32


def bucket_sizes(limit: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 8, all below `limit`, then `limit` itself (so the largest
    bucket is exactly the most rows a step can have, and nothing past it is captured)."""
    if limit < 1:
        raise ValueError(f"bucket limit must be >= 1, got {limit}")
    sizes = [b for b in SMALL_BUCKETS if b < limit]
    sizes += range(SMALL_BUCKETS[-1] + BUCKET_STEP, limit, BUCKET_STEP)
    return [*sizes, limit]


def buckets_for(config: EngineConfig, recorded: bool = False) -> list[int]:
    """The batch sizes captured for `config`: up to min(max_cuda_graph_batch_size, max_num_seqs);
    where they are recorded kernel programs (the CPU), every size up to CPU_MAX_BUCKET too."""
    limit = min(config.parallel.max_cuda_graph_batch_size, config.scheduler.max_num_seqs)
    return list(range(1, min(limit, CPU_MAX_BUCKET) + 1)) if recorded else bucket_sizes(limit)


def can_capture(config: EngineConfig, attn: AttentionBackend, device: torch.device) -> bool:
    """Whether decode steps are captured: CUDA, no --enforce-eager, a backend that supports it."""
    return device.type == "cuda" and not config.parallel.enforce_eager and attn.supports_decode_graphs


class DecodeBuffers:
    """The static inputs every graph reads, for up to `max_rows` rows, and how a step fills them.
    With Bmax = max_rows and max_blocks = ceil(max_model_len / block_size): input_ids [Bmax]
    int64, positions [Bmax] int64, block_tables [Bmax, max_blocks] int32, seq_lens [Bmax] int32,
    slot_mapping [Bmax] int64. Padding rows decode token 0 at position 0 with seq_len 1 through a
    table of the scratch block only: their KV lands there and they attend only to it."""

    def __init__(self, max_rows: int, max_blocks: int, scratch_block: int, device: torch.device) -> None:
        self.max_rows, self.max_blocks, self.scratch_block = max_rows, max_blocks, scratch_block
        self.input_ids = torch.zeros(max_rows, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_rows, dtype=torch.int64, device=device)
        self.block_tables = torch.full((max_rows, max_blocks), scratch_block, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(max_rows, dtype=torch.int32, device=device)
        self.slot_mapping = torch.zeros(max_rows, dtype=torch.int64, device=device)

    def fill(
        self, input_ids: torch.Tensor, positions: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor, bucket: int
    ) -> None:
        """Rows [:B] := the step's, rows [B:bucket] := padding (token 0, position 0, seq_len 1,
        a table of the scratch block). Copies only; no sync."""
        num_rows, width = block_tables.shape
        if not num_rows <= bucket <= self.max_rows or width > self.max_blocks:
            raise ValueError(f"a step of {num_rows} rows x {width} blocks in a bucket of {bucket} x {self.max_blocks}")
        if not input_ids.shape == positions.shape == seq_lens.shape == (num_rows,):
            shapes = [tuple(t.shape) for t in (input_ids, positions, seq_lens)]
            raise ValueError(f"input_ids, positions, seq_lens must be [{num_rows}], got {shapes}")
        self.input_ids[:num_rows].copy_(input_ids, non_blocking=True)
        self.positions[:num_rows].copy_(positions, non_blocking=True)
        self.seq_lens[:num_rows].copy_(seq_lens, non_blocking=True)
        self.block_tables[:num_rows, :width].copy_(block_tables, non_blocking=True)
        self.block_tables[:bucket, width:].fill_(self.scratch_block)
        if bucket > num_rows:
            self.input_ids[num_rows:bucket].zero_()
            self.positions[num_rows:bucket].zero_()
            self.seq_lens[num_rows:bucket].fill_(1)
            self.block_tables[num_rows:bucket].fill_(self.scratch_block)

    def compute_slot_mapping(self, bucket: int, block_size: int) -> None:
        """slot_mapping[:bucket] from the tables and positions, on the device (inside the graph):
        the block holding each row's position, times block_size, plus the offset in it."""
        positions = self.positions[:bucket]
        blocks = self.block_tables[:bucket].gather(1, (positions // block_size).unsqueeze(1)).squeeze(1)  # [bucket] int32
        torch.add(blocks.long() * block_size, positions % block_size, out=self.slot_mapping[:bucket])


class DecodeGraphs:
    """The decode graphs of one model over one set of KV caches.

    model: its forward (DecodeModel); attn: its attention backend (must support CUDA graphs);
    kv_caches: one per layer, as the model takes them; buckets: the batch sizes to capture;
    max_blocks_per_seq: the static tables' width; scratch_block: the padding rows' KV block;
    capture: False runs the model eagerly through the same buffers (any device); pool: a graph
    memory pool to capture into (another DecodeGraphs' `pool`), None for a new one; record: on
    the CPU, the ops' Ops.record, which `capture_all` asks for each bucket's program (None: none).

    How the runner (gpu/step/runner.py) uses it:
    1. Start-up, model loaded: if not `can_capture(config, attn, device)`, nor on the CPU with
       `attn.supports_decode_graphs`, it never builds one; every step runs eagerly.
    2. KV sizing, BEFORE the profile run: `probe = DecodeGraphs.memory_probe(...)`, then
       `probe.capture_all()` -> (seconds, graph_bytes); the profile run and
       `num_blocks_for_memory` follow with `probe` alive, so its graph pool (the largest
       bucket's activations, graph_bytes measured with torch.cuda.mem_get_info around the
       capture) is in use then and the KV budget leaves it out. The probe captures over a cache
       of one block of its own: only padding rows run in a capture, touching the scratch block
       only. Before, not after, the profile run: every capture begins with
       torch.cuda.empty_cache(), which would hand back the activation peak the sizing must see.
       The CPU has no probe: its programs' memory is the host's, not the KV pool's.
    3. After the pool is allocated with one block reserved as scratch: `from_config(config,
       model, attn, kv_caches, scratch_block=scratch, device=device, pool=probe.pool)`, then
       `capture_all()` (it logs each bucket's time and memory), then the probe is dropped.
       Sharing the probe's pool lets the real graphs reuse the memory the probe measured
       (graphs of one pool share their intermediates; only one runs at a time).
    4. Per step: if every row decodes and `bucket_for(B)` is not None, `run(...)` -> hidden
       [B, H], valid until the next `run`, so the logits are computed from it first; otherwise
       the eager path."""

    def __init__(
        self,
        model: DecodeModel,
        attn: AttentionBackend,
        kv_caches: list[torch.Tensor],
        *,
        buckets: list[int],
        max_blocks_per_seq: int,
        block_size: int,
        sliding_window: int | None,
        scratch_block: int,
        device: torch.device,
        capture: bool,
        pool: _POOL_HANDLE | None = None,
        record: Recorder | None = None,
    ) -> None:
        if not attn.supports_decode_graphs:
            raise ValueError(f"{type(attn).__name__} reads host data per step: its decode steps cannot be captured")
        if capture and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {device}")
        if not buckets or buckets != sorted(set(buckets)) or buckets[0] < 1:
            raise ValueError(f"buckets must be distinct, ascending and >= 1: {buckets}")
        if not 0 <= scratch_block < kv_caches[0].shape[1]:
            raise ValueError(f"scratch block {scratch_block} outside the pool [0, {kv_caches[0].shape[1]})")
        self.model, self.kv_caches = model, kv_caches
        self.buckets, self.block_size, self.capture = buckets, block_size, capture
        self.buffers = DecodeBuffers(buckets[-1], max_blocks_per_seq, scratch_block, device)
        b = self.buffers
        self._metas = {
            n: attn.build_graph_metadata(
                slot_mapping=b.slot_mapping[:n],
                seq_lens=b.seq_lens[:n],
                block_tables=b.block_tables[:n],
                positions=b.positions[:n],
                block_size=block_size,
                sliding_window=sliding_window,
            )
            for n in buckets
        }
        self.pool = (pool or torch.cuda.graph_pool_handle()) if capture else None
        self.record = None if capture else record
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._replays: dict[int, Replay] = {}  # bucket -> its recorded program (CPU)
        self._seen: set[int] = set()  # buckets that ran once eagerly (CPU): the next step records
        self._refused: set[int] = set()  # buckets the ops could not record (CPU): eager for good
        self._reasons: set[str] = set()  # NotRecordable's messages, logged once each
        self._outputs: dict[int, torch.Tensor] = {}  # bucket -> hidden [bucket, H], written by its graph

    @classmethod
    def from_config(
        cls,
        config: EngineConfig,
        model: DecodeModel,
        attn: AttentionBackend,
        kv_caches: list[torch.Tensor],
        *,
        scratch_block: int,
        device: torch.device,
        largest_only: bool = False,
        pool: _POOL_HANDLE | None = None,
        record: Recorder | None = None,
    ) -> DecodeGraphs:
        """The graphs `config` asks for (`buckets_for`; only the largest with largest_only),
        captured where `can_capture` says so, else recorded by `record` where given (the CPU)."""
        record = None if config.parallel.enforce_eager else record
        buckets = buckets_for(config, recorded=record is not None)
        block_size = config.cache.block_size
        return cls(
            model,
            attn,
            kv_caches,
            buckets=buckets[-1:] if largest_only else buckets,
            max_blocks_per_seq=-(-config.model.max_model_len // block_size),
            block_size=block_size,
            sliding_window=config.model.sliding_window,
            scratch_block=scratch_block,
            device=device,
            capture=can_capture(config, attn, device),
            pool=pool,
            record=record,
        )

    @classmethod
    def memory_probe(cls, config: EngineConfig, model: DecodeModel, attn: AttentionBackend, device: torch.device) -> DecodeGraphs:
        """The largest bucket alone over a one-block cache of its own, to measure with
        `capture_all` what the graphs will take before the KV pool is sized (the class docstring, 2)."""
        cache = attn.allocate_kv_caches(1, config.cache.block_size)
        return cls.from_config(config, model, attn, cache, scratch_block=0, device=device, largest_only=True)

    def bucket_for(self, num_rows: int) -> int | None:
        """The smallest bucket that holds `num_rows` (>= 1) rows; None past the largest: run eagerly."""
        i = bisect.bisect_left(self.buckets, num_rows)
        return self.buckets[i] if num_rows >= 1 and i < len(self.buckets) else None

    @torch.inference_mode()
    def capture_all(self) -> tuple[float, int]:
        """Capture every bucket, largest first (the smaller ones reuse its pool) -> (seconds, bytes
        of device memory the graphs took, from torch.cuda.mem_get_info; in a pool shared with a
        probe, what they took beyond it). Each bucket first runs
        once eagerly, so Triton compiles and cuBLAS sets up outside the capture. The buffers hold
        padding only meanwhile: capture writes no KV but the scratch block's. Without capture:
        (0, 0), the CPU's programs included: `run` records each bucket as it serves its second
        step (its first runs eagerly, as a capture's warm-up, and sets up what the ops build
        lazily), so recording costs no start-up time and no extra forward."""
        if self.record is not None:
            log.info("decode steps of 1 to %d rows replay kernel programs, each recorded on its second step", self.buckets[-1])
            return 0.0, 0
        if not self.capture:
            return 0.0, 0
        device = self.buffers.input_ids.device
        started = time.perf_counter()
        warmup = torch.cuda.Stream(device)
        warmup.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(warmup):
            for bucket in self.buckets:
                self._forward(bucket)
        torch.cuda.current_stream(device).wait_stream(warmup)
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()  # as each capture begins by doing: the warm-up's blocks must not count as freed
        free_before = torch.cuda.mem_get_info(device)[0]
        for bucket in reversed(self.buckets):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self._outputs[bucket] = self._forward(bucket)
            self._graphs[bucket] = graph
        torch.cuda.synchronize(device)
        num_bytes = max(0, free_before - torch.cuda.mem_get_info(device)[0])
        seconds = time.perf_counter() - started
        log.info(
            "captured %d decode CUDA graphs (batch sizes %d..%d) in %.1f s, %.0f MiB of graph memory",
            len(self.buckets),
            self.buckets[0],
            self.buckets[-1],
            seconds,
            num_bytes / 2**20,
        )
        return seconds, num_bytes

    @torch.inference_mode()
    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor
    ) -> torch.Tensor:
        """A decode step of B rows: input_ids, positions [B] int64, block_tables [B, <= max_blocks]
        int32, seq_lens [B] int32 (after this step's token), on the device -> hidden [B, H], a view
        valid until the next run. Raises when B has no bucket (check `bucket_for` first)."""
        num_rows = input_ids.shape[0]
        bucket = self.bucket_for(num_rows)
        if bucket is None:
            raise ValueError(f"no decode graph for {num_rows} rows (buckets up to {self.buckets[-1]})")
        self.buffers.fill(input_ids, positions, block_tables, seq_lens, bucket)
        replay = self._replays.get(bucket)
        if replay is not None:
            self.buffers.compute_slot_mapping(bucket, self.block_size)  # torch ops: before the program, not in it
            replay.replay()
            return self._outputs[bucket][:num_rows]
        if self.record is not None and bucket not in self._refused:
            if bucket in self._seen:
                return self._recorded(bucket)[:num_rows]
            self._seen.add(bucket)
        if not self.capture:
            return self._forward(bucket)[:num_rows]
        if bucket not in self._graphs:
            raise RuntimeError("run before capture_all")
        self._graphs[bucket].replay()
        return self._outputs[bucket][:num_rows]

    def _recorded(self, bucket: int) -> torch.Tensor:
        """The forward of the buffers' first `bucket` rows, recorded as it runs (Ops.record) ->
        its output. A bucket the ops cannot record is refused for good (logged once per reason)
        and this step runs again eagerly: a recording stopped part-way wrote only KV that the
        eager forward writes again, alike."""
        assert self.record is not None
        b = self.buffers
        b.compute_slot_mapping(bucket, self.block_size)
        forward = functools.partial(self.model, b.input_ids[:bucket], b.positions[:bucket], self._metas[bucket], self.kv_caches)
        try:
            self._outputs[bucket], self._replays[bucket] = self.record(forward)
        except NotRecordable as exc:
            self._refused.add(bucket)
            if str(exc) not in self._reasons:
                self._reasons.add(str(exc))
                log.info("decode steps of %d rows (and others like them) run eagerly: %s", bucket, exc)
            return self._forward(bucket)
        arena = getattr(self._replays[bucket], "num_bytes", 0) / 2**20
        log.debug("recorded the decode kernel program of %d rows (arena %.1f MiB)", bucket, arena)
        return self._outputs[bucket]

    def _forward(self, bucket: int) -> torch.Tensor:
        """What a graph holds: the slot mapping, then the model over the first `bucket` rows."""
        b = self.buffers
        b.compute_slot_mapping(bucket, self.block_size)
        return self.model(b.input_ids[:bucket], b.positions[:bucket], self._metas[bucket], self.kv_caches)
