"""The fused-MoE Triton path (grouped GEMM over expert-sorted tokens) against the torch grouped path.

Without CUDA the kernel runs under Triton's interpreter (TRITON_INTERPRET=1, set by
tests/conftest.py before triton is imported), on tiny shapes. Tolerances: fp32 within 1e-5 (the
same products, summed in another order); fp16 within 2e-3 (one fp16 ulp or two: the sum over the
K experts rounds once here and after each add in torch). bf16 runs on a GPU only (marked gpu).
"""

from __future__ import annotations

import textwrap

import pytest
import torch

from conveyor.gpu.backends.torch.moe import grouped_moe
from tests.triton_compile import compile_for_sm90

pytest.importorskip("triton")

from conveyor.gpu.backends.torch import TorchOps  # noqa: E402
from conveyor.gpu.backends.triton.backend import TritonAttention, TritonOps  # noqa: E402
from conveyor.gpu.backends.triton.fused_moe import fused_moe, sort_by_expert  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def make_inputs(num_tokens, num_experts, top_k, hidden, inter, dtype, seed=0, unused_experts=0):
    """Random activations and experts, and routing that never picks the last `unused_experts`."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen)
    gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    down = torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5
    chosen = num_experts - unused_experts
    ids = torch.stack([torch.randperm(chosen, generator=gen)[:top_k] for _ in range(num_tokens)]).reshape(num_tokens, top_k)
    weights = torch.softmax(torch.randn(num_tokens, top_k, generator=gen), -1)
    return [t.to(DEVICE) for t in (x.to(dtype), gate_up.to(dtype), down.to(dtype), weights, ids)]


@pytest.mark.parametrize(("num_tokens", "top_k", "block_m"), [(1, 2, 16), (7, 2, 16), (40, 2, 64), (5, 1, 16)])
def test_sort_by_expert_groups_pairs_into_single_expert_blocks(num_tokens, top_k, block_m):
    num_experts = 8
    *_, ids = make_inputs(num_tokens, num_experts, top_k, 16, 16, torch.float32, seed=num_tokens, unused_experts=2)
    sorted_pairs, block_experts = sort_by_expert(ids, num_experts, block_m)
    num_pairs = num_tokens * top_k
    flat = ids.reshape(-1).cpu()
    pairs, experts = sorted_pairs.cpu().view(-1, block_m), block_experts.cpu()
    assert sorted(p for p in sorted_pairs.tolist() if p < num_pairs) == list(range(num_pairs))  # each pair once
    for block, expert in zip(pairs, experts.tolist()):
        real = block[block < num_pairs]
        if expert < 0:
            assert real.numel() == 0
        else:
            assert real.numel() > 0 and (flat[real] == expert).all()
            assert real.tolist() == sorted(real.tolist())  # pair order kept inside a group
    assert experts[experts >= 0].tolist() == sorted(experts[experts >= 0].tolist())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    ("num_tokens", "num_experts", "top_k", "hidden", "inter"),
    [(1, 4, 2, 64, 32), (9, 8, 2, 64, 32), (40, 8, 2, 64, 32), (6, 4, 1, 48, 24), (5, 6, 3, 80, 40)],
)
def test_fused_moe_matches_torch(num_tokens, num_experts, top_k, hidden, inter, dtype):
    """Decode-sized and prompt-sized steps (40 tokens x 2 take the 64-row blocks), K = 1 to 3,
    widths that are not powers of two (masked tiles), experts nobody chose."""
    inputs = make_inputs(num_tokens, num_experts, top_k, hidden, inter, dtype, seed=num_tokens, unused_experts=1)
    out = fused_moe(*inputs)
    assert out.shape == (num_tokens, hidden) and out.dtype == dtype
    torch.testing.assert_close(out, grouped_moe(*inputs), rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])


def test_weights_in_the_model_dtype_and_no_tokens():
    x, gate_up, down, weights, ids = make_inputs(5, 4, 2, 64, 32, torch.float16, seed=3)
    half = weights.half()  # Qwen MoE rounds its routing weights to the model dtype
    torch.testing.assert_close(fused_moe(x, gate_up, down, half, ids), grouped_moe(x, gate_up, down, half, ids), rtol=2e-3, atol=2e-3)
    empty = fused_moe(x[:0], gate_up, down, weights[:0], ids[:0])
    assert empty.shape == (0, 64)


def test_rejects_mismatched_inputs():
    x, gate_up, down, weights, ids = make_inputs(3, 4, 2, 64, 32, torch.float32)
    with pytest.raises(ValueError, match="gate_up"):
        fused_moe(x, gate_up[:, :10], down, weights, ids)
    with pytest.raises(ValueError, match="topk_weights"):
        fused_moe(x, gate_up, down, weights[:, :1], ids)
    with pytest.raises(ValueError, match="x "):
        fused_moe(x.t(), gate_up, down, weights, ids)


class _TorchOpsWithFusedMoe(TorchOps):
    def moe_experts(self, x, gate_up, down, topk_weights, topk_ids):
        return fused_moe(x, gate_up, down, topk_weights, topk_ids)


class _TritonOpsWithFusedMoe(TritonOps):
    def moe_experts(self, x, gate_up, down, topk_weights, topk_ids):
        return fused_moe(x, gate_up, down, topk_weights, topk_ids)


@pytest.mark.parametrize(
    ("name", "backend_name"), [("mixtral", "torch"), ("qwen2_moe", "torch"), ("qwen3_moe_norm", "triton"), ("mixtral", "triton")]
)
def test_model_logits_through_the_kernel_match_hf(name, backend_name):
    """The models' forward with the experts in the kernel: on the torch backend otherwise, and on
    the whole Triton backend (paged attention, norms incl. Qwen3's per-head q/k norms, rotary,
    SiLU x up), as TritonOps would run them once it routes moe_experts to the kernel."""
    from conveyor.gpu.backends import Backend
    from conveyor.gpu.backends.torch import TorchAttention
    from tests.gpu.test_gpu_model import forward_prompts, random_prompts
    from tests.gpu.test_moe import build
    from tests.moe_checkpoints import hf_model, model_config

    config = model_config(name)
    cpu = torch.device("cpu")
    if backend_name == "torch":
        backend = Backend("torch", TorchAttention(config, cpu), _TorchOpsWithFusedMoe(), "torch with the Triton experts")
    else:
        backend = Backend("triton", TritonAttention(config, cpu), _TritonOpsWithFusedMoe(), "triton with the Triton experts")
    model = build(name, backend)
    lengths = [9, 1, 14]
    ours = forward_prompts(model, config, random_prompts(lengths, seed=4))
    hf = hf_model(name)
    with torch.no_grad():
        ref = torch.cat([hf(torch.tensor([p])).logits[0] for p in random_prompts(lengths, seed=4)])
    assert (ours - ref).abs().max() <= 1e-4 * ref.abs().max()


COMPILE_FOR_SM90 = textwrap.dedent("""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from conveyor.gpu.backends.triton.fused_moe import _grouped_gemm_kernel as fn

    for dtype, precision in (("bf16", None), ("fp16", None), ("fp32", "ieee")):
        for has_weights in (False, True):
            constexprs = dict(PAIRS_PER_ROW=2, HAS_WEIGHTS=has_weights, BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, UPCAST=False,
                              PRECISION=precision)
            types = dict(a_ptr="*" + dtype, b_ptr="*" + dtype, c_ptr="*" + dtype, weights_ptr="*fp32",
                         sorted_pairs_ptr="*i32", block_experts_ptr="*i32")
            signature = {name: "constexpr" if name in constexprs else types.get(name, "i32") for name in fn.arg_names}
            triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget("cuda", 90, 32))
""")


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA the GPU tests compile and run the kernel")
def test_kernel_compiles_for_sm90():
    compile_for_sm90(COMPILE_FOR_SM90, timeout_s=180)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_model_sized_shapes_on_cuda(dtype):
    inputs = make_inputs(300, 8, 2, 1024, 704, dtype, seed=7, unused_experts=1)
    torch.testing.assert_close(fused_moe(*inputs), grouped_moe(*inputs), rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])
