"""The KV host tier (gpu/kv/host_tier.py): blocks of the device pool go to host slots and come back
byte for byte into other blocks, in each backend's own layout (torch, cpu; fp8 codes too), through
the disk tier as well; a slot's bytes are the block's, layer after layer; bad transfers are refused.
The CUDA path (pinned pool, side stream, staging chunks) is checked where a device is."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conveyor.gpu.backends import select
from conveyor.gpu.backends.cpu.kernels import paged_attention_kernel
from conveyor.gpu.kv.disk_format import KVValidity
from conveyor.gpu.kv.disk_tier import DiskTier
from conveyor.gpu.kv.host_tier import HostTier, num_host_slots
from conveyor.gpu.models.registry import read_model_config
from tests.gpu_checkpoints import checkpoint

BLOCK_SIZE = 4
NUM_BLOCKS = 8
needs_kernel = pytest.mark.skipif(paged_attention_kernel() is None, reason="no C++ compiler for the CPU kernels")


@dataclasses.dataclass(frozen=True)
class Case:
    backend: str
    dtype: str
    kv_dtype: str | None = None


CASES = [
    pytest.param(Case("torch", "float32"), id="torch-float32"),
    pytest.param(Case("torch", "bfloat16"), id="torch-bfloat16"),
    pytest.param(Case("torch", "bfloat16", "float8_e4m3fn"), id="torch-fp8"),
    pytest.param(Case("cpu", "float32"), id="cpu-float32", marks=needs_kernel),
]


def kv_caches(case: Case, device: str = "cpu") -> tuple[list[torch.Tensor], int]:
    """The backend's own caches, every byte random; and its bytes_per_block."""
    backend = select(case.backend, device, read_model_config(checkpoint("llama"), dtype=case.dtype), case.kv_dtype)
    assert backend.name == case.backend
    caches = backend.attn.allocate_kv_caches(NUM_BLOCKS, BLOCK_SIZE)
    generator = torch.Generator().manual_seed(0)
    for cache in caches:
        raw = cache.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=generator))
    return caches, backend.attn.bytes_per_block(BLOCK_SIZE)


def blocks_of(caches: list[torch.Tensor], block: int) -> list[torch.Tensor]:
    """Block `block` of every layer, keys and values, as bytes (a copy)."""
    return [c.view(torch.uint8)[:, block].clone() for c in caches]


def assert_same(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert all(torch.equal(g.cpu(), w.cpu()) for g, w in zip(got, want))


@pytest.mark.parametrize("case", CASES)
def test_blocks_go_to_slots_and_back_into_other_blocks(case):
    caches, bytes_per_block = kv_caches(case)
    host = HostTier(caches, num_slots=5)
    assert host.bytes_per_slot == bytes_per_block
    before = {b: blocks_of(caches, b) for b in range(NUM_BLOCKS)}
    assert host.save([5, 2, 7], [3, 0, 1]).ready()
    for cache in caches:
        cache.zero_()
    assert host.load([0, 1, 3], [4, 6, 1]).ready()
    assert_same(blocks_of(caches, 4), before[2])
    assert_same(blocks_of(caches, 6), before[7])
    assert_same(blocks_of(caches, 1), before[5])
    for untouched in (0, 2, 3, 5, 7):
        assert all(not b.any() for b in blocks_of(caches, untouched))


@pytest.mark.parametrize("case", CASES)
def test_a_slot_is_the_block_layer_after_layer_keys_then_values(case):
    caches, _ = kv_caches(case)
    host = HostTier(caches, num_slots=2)
    host.save([3], [1])
    want = torch.cat([b.flatten() for b in blocks_of(caches, 3)])
    assert bytes(host.block_bytes(1)) == want.numpy().tobytes()


@pytest.mark.parametrize("case", CASES)
def test_blocks_come_back_through_the_disk_tier(case, tmp_path):
    caches, bytes_per_block = kv_caches(case)
    host = HostTier(caches, num_slots=2)
    validity = KVValidity(model="llama-tiny", kv_dtype=str(caches[0].dtype), block_size=BLOCK_SIZE, layout=case.backend)
    disk = DiskTier(tmp_path, validity=validity, payload_bytes=host.bytes_per_slot, capacity_bytes=10 * bytes_per_block + 1000)
    want = blocks_of(caches, 6)
    host.save([6], [0]).wait()
    assert disk.put(1234, host.block_bytes(0))
    disk.close()  # a restart: nothing but the directory survives
    host.fill(0, bytes(host.bytes_per_slot))
    again = DiskTier(tmp_path, validity=validity, payload_bytes=host.bytes_per_slot, capacity_bytes=10 * bytes_per_block + 1000)
    assert again.hashes() == [1234] and again.read_into(1234, host.block_bytes(1))
    host.load([1], [2])
    assert_same(blocks_of(caches, 2), want)
    data = again.get(1234)
    assert data is not None
    host.fill(0, data)
    assert bytes(host.block_bytes(0)) == bytes(host.block_bytes(1))
    again.close()


def test_bad_transfers_are_refused():
    caches, _ = kv_caches(Case("torch", "float32"))
    host = HostTier(caches, num_slots=4)
    with pytest.raises(ValueError, match="writes a slot twice"):
        host.save([1, 2], [3, 3])
    with pytest.raises(ValueError, match="writes a block twice"):
        host.load([0, 1], [5, 5])
    with pytest.raises(ValueError, match="outside"):
        host.save([NUM_BLOCKS], [0])
    with pytest.raises(ValueError, match="outside"):
        host.load([4], [0])
    with pytest.raises(ValueError, match="2 blocks and 1 slots"):
        host.save([1, 2], [0])
    assert host.save([], []).ready()
    with pytest.raises(ValueError, match="at least one slot"):
        HostTier(caches, num_slots=0)
    with pytest.raises(ValueError, match="contiguous"):
        HostTier([c.transpose(2, 3) for c in caches], num_slots=1)


def test_the_pool_is_sized_in_gib():
    assert num_host_slots(1.0, 2 * 2**20) == 512
    assert num_host_slots(0.001, 2 * 2**20) == 0


@pytest.mark.cuda
def test_cuda_transfers_run_on_a_side_stream_in_staging_chunks():
    caches, _ = kv_caches(Case("torch", "bfloat16"), device="cuda")
    # Two slots of staging: seven blocks go in four chunks, slots in runs and alone.
    host = HostTier(caches, num_slots=8, staging_bytes=2 * sum(c[:, 0].numel() * c.element_size() for c in caches))
    assert host.pool.is_pinned()
    before = {b: blocks_of(caches, b) for b in range(NUM_BLOCKS)}
    blocks, slots = [0, 1, 2, 3, 4, 5, 6], [7, 2, 3, 4, 0, 6, 1]
    saved = host.save(blocks, slots)
    saved.wait()
    assert saved.ready()
    for cache in caches:
        cache.zero_()
    loaded = host.load(slots, blocks[::-1])
    loaded.wait_on_stream()
    torch.cuda.current_stream().synchronize()
    for b, want in zip(blocks[::-1], blocks):
        assert_same(blocks_of(caches, b), before[want])
    host.close()
