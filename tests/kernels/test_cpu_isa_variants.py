"""The C++ CPU kernels' ISA variants (gpu/backends/cpu/kernels/isa.py), CONVEYOR_CPU_ISA and the
build's refusal of a variant this CPU cannot run.

- the table tells the truth: each variant's flags make the compiler define exactly the guard
  macros its features name, and its quant_linear library holds the byte-product instructions
  (and register width) that `kernel_paths` says it runs;
- a variant this CPU lacks a feature of, or an unknown one, is refused before the compiler runs:
  logged, and the torch path serves; CONVEYOR_CPU_ISA picks the flags; the cpu backend logs the
  CPU's model and the variant once;
- the float kernels (paged attention, fp8 caches included; the fused ops; small_linear) of each
  variant this CPU runs, through the existing tests' own checks, with the variant's library in
  place of the native one. The quantized linear and the argmax head are checked per variant in
  test_cpu_quant_linear.py and test_cpu_quant_argmax.py.
"""

from __future__ import annotations

import logging
import os
import platform
import re
import shutil
import subprocess
import types

import pytest

from conveyor.gpu.backends import select
from conveyor.gpu.backends.cpu.kernels import build, isa
from conveyor.gpu.backends.cpu.kernels.fused_ops import CpuFusedOps
from conveyor.gpu.backends.cpu.kernels.paged_attention import PagedAttentionKernel
from conveyor.gpu.backends.cpu.kernels.small_linear import CpuSmallLinear
from conveyor.gpu.backends.cpu.ops import CpuOps
from conveyor.gpu.kv.kv_fp8 import UNIT_SCALES, KVScales
from tests.kernels import test_gpu_attention, test_gpu_fused_ops, test_gpu_small_linear, test_kv_fp8
from tests.kernels.cpu_isa import variant_params

COMPILER = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
needs_compiler = pytest.mark.skipif(COMPILER is None or build.load_library("fused_ops") is None, reason="no C++ compiler")
INT8_VARIANTS = variant_params(int8=True)
FLOAT_VARIANTS = variant_params(int8=False)[1:]  # native's are the other test files' subject


def library(name: str, variant: str):
    """`name` built for `variant`; native called as the kernels' own wrappers call it (the same
    functools.cache key: one build a session, whose cache directory is fresh)."""
    lib = build.load_library(name) if variant == "native" else build.load_library(name, variant)
    assert lib is not None, f"{name}.cpp did not build for {variant}"
    return lib


@needs_compiler
@pytest.mark.parametrize("variant", list(isa.VARIANTS))
def test_the_flags_define_the_guards_the_features_name(variant):
    """Preprocessor only: no CPU needed, so every variant, this CPU's lacks included."""
    v = isa.VARIANTS[variant]
    if v.features is None and isa.cpu_features() is None:
        pytest.skip("native's features cannot be read here")
    if v.features is not None and platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip(f"{variant} is x86-64's, this is {platform.machine()}")
    assert COMPILER is not None
    macros = subprocess.run([COMPILER, *v.flags, "-dM", "-E", "-x", "c++", os.devnull], capture_output=True, text=True, check=True)
    defined = set(re.findall(r"#define (__\w+__) ", macros.stdout))
    features = isa.build_features(v)
    assert {m for f, m in isa.GUARDS.items() if f in features} == defined & set(isa.GUARDS.values())


@needs_compiler
@pytest.mark.skipif(shutil.which("objdump") is None, reason="no objdump")
@pytest.mark.parametrize("variant", INT8_VARIANTS)
def test_the_library_runs_the_paths_the_table_names(variant):
    """quant_linear's int8 products and vector width, read from the built library's code."""
    lib = library("quant_linear", variant)
    code = subprocess.run(["objdump", "-d", "--no-show-raw-insn", lib._name], capture_output=True, text=True, check=True).stdout
    paths = isa.kernel_paths(isa.build_features(isa.VARIANTS[variant]))
    dots = set(re.findall(r"((?:\{vex\} )?(?:vpdpbusd|vpmaddubsw)) +%([xyz]mm)", code))
    width = "zmm" if paths.float_lanes == 16 else "ymm"
    if paths.int8 is None:
        pytest.skip("no int8 path in this build (no AVX2)")
    if "vpdpbusd" in paths.int8:
        want = {("{vex} vpdpbusd" if "AVX-VNNI" in paths.int8 else "vpdpbusd", width)}
    else:
        want = {("vpmaddubsw", width)}
    assert dots == want, (paths, dots)
    assert ("%zmm" in code) == (paths.float_lanes == 16)


@pytest.fixture
def fresh_loads():
    build.load_library.cache_clear()
    yield
    build.load_library.cache_clear()


def test_a_variant_the_cpu_lacks_is_refused_before_any_build(monkeypatch, caplog, fresh_loads):
    monkeypatch.setattr(isa, "cpu_features", lambda: isa.VARIANTS["x86-64-v3"].features)  # an AVX2 machine
    monkeypatch.setattr(build, "_build", lambda *a: pytest.fail("the compiler ran"))
    with caplog.at_level(logging.WARNING):
        assert build.load_library("fused_ops", "x86-64-v4-vnni-bf16") is None
        assert build.load_library("fused_ops", "avx9000") is None
    assert "lacks avx512_bf16, avx512_vnni, avx512bw, avx512cd, avx512dq, avx512f, avx512vl, which x86-64-v4-vnni-bf16" in caplog.text
    assert "unknown CPU ISA variant 'avx9000'" in caplog.text and "one of native, x86-64-v3" in caplog.text
    monkeypatch.setattr(isa, "cpu_features", lambda: None)  # no /proc/cpuinfo: native only
    assert isa.missing_features(isa.VARIANTS["x86-64-v3"]) is None
    assert isa.missing_features(isa.VARIANTS["native"]) == []
    assert "refused" in isa.describe("x86-64-v3") and "refused" not in isa.describe("native")


def test_the_environment_picks_the_flags(monkeypatch, fresh_loads):
    built = []

    def record(source, flags):
        built.append(flags)
        raise RuntimeError("not built: the flags were the question")

    monkeypatch.setattr(build, "_build", record)
    every = frozenset().union(*(v.features for v in isa.VARIANTS.values() if v.features is not None))
    monkeypatch.setattr(isa, "cpu_features", lambda: every)
    monkeypatch.delenv("CONVEYOR_CPU_ISA", raising=False)
    assert build.load_library("lora") is None
    monkeypatch.setenv("CONVEYOR_CPU_ISA", "x86-64-v3-vnni")
    build.load_library.cache_clear()
    assert build.load_library("lora") is None
    assert built == [("-march=native",), ("-march=x86-64-v3", "-mavxvnni")]
    assert "kernels built for x86-64-v3-vnni (-march=x86-64-v3 -mavxvnni)" in isa.describe("x86-64-v3-vnni")
    assert str(isa.kernel_paths(isa.VARIANTS["x86-64-v3-vnni"].features)).endswith("vpdpbusd (AVX-VNNI, ymm)")


def test_the_cpu_is_named_with_its_family_and_model(monkeypatch):
    fields = {"model name": "Intel(R) Xeon(R) Processor", "cpu family": "6", "model": "207"}
    monkeypatch.setattr(isa, "_cpuinfo", lambda: fields)
    assert isa.cpu_model() == "Intel(R) Xeon(R) Processor (family 6, model 207)"
    monkeypatch.setattr(isa, "_cpuinfo", lambda: {"model name": "Neoverse-V2"})  # no x86 family: the name alone
    assert isa.cpu_model() == "Neoverse-V2"


@needs_compiler
def test_the_cpu_backend_logs_the_cpu_and_the_variant(caplog):
    model = types.SimpleNamespace(num_layers=1, num_kv_heads=2, head_dim=32, dtype="float32", attn_logit_softcap=None)
    with caplog.at_level(logging.INFO, logger="conveyor.gpu.backends.cpu"):
        select("cpu", "cpu", model)
    lines = [r.getMessage() for r in caplog.records if r.name == "conveyor.gpu.backends.cpu"]
    assert lines == [f"CPU {isa.describe('native')}"]
    assert lines[0].startswith(f"CPU {isa.cpu_model()}; kernels built for native (-march=native): float32 vectors of")


@needs_compiler
@pytest.mark.parametrize("variant", FLOAT_VARIANTS)
def test_paged_attention(variant, monkeypatch):
    kernel = PagedAttentionKernel(library("paged_attention", variant))
    monkeypatch.setattr(test_gpu_attention, "paged_attention_kernel", lambda: kernel)
    for head_dim in (32, 64, 128, 20):  # the specialised widths, and the generic loop
        test_gpu_attention.test_cpu_kernel_matches_reference(8, 2, head_dim, 5)
    for heads, head_dim, window in (((8, 4), 64, None), ((12, 4), 128, 37), ((8, 1), 32, 5)):
        test_gpu_attention.test_cpu_kernel_prompt_tiles(*heads, head_dim, window)
    test_gpu_attention.test_cpu_kernel_long_contexts_across_block_sizes(16)
    monkeypatch.setattr("conveyor.gpu.backends.cpu.paged_attention_kernel", lambda: kernel)  # select's
    for head_dim, group in ((32, 2), (16, 3)):
        test_kv_fp8.test_fp8_cache_attention("cpu", KVScales(k=0.5, v=2.0), head_dim, group)
        test_kv_fp8.test_every_code_reads_back_exactly("cpu", head_dim)
    test_kv_fp8.test_fp8_cache_attention("cpu", UNIT_SCALES, 32, 2)


@needs_compiler
@pytest.mark.parametrize("variant", FLOAT_VARIANTS)
def test_fused_ops_and_small_linear(variant, monkeypatch):
    fused = CpuFusedOps(library("fused_ops", variant))
    monkeypatch.setattr(test_gpu_fused_ops, "ops", fused)
    monkeypatch.setattr(test_gpu_fused_ops, "cpu_ops", CpuOps(fused, None))
    for tokens in test_gpu_fused_ops.TOKENS:
        test_gpu_fused_ops.test_rms_norm_with_and_without_the_residual(tokens)
        test_gpu_fused_ops.test_rotary_in_place_matches_the_torch_rotation(tokens)
        test_gpu_fused_ops.test_silu_mul(tokens)
    test_gpu_fused_ops.test_mlp_takes_the_c_path_only_for_what_it_supports()
    monkeypatch.setattr(test_gpu_small_linear, "small", CpuSmallLinear(library("small_linear", variant)))
    for rows in (1, 3, 8, 9, 17, 300):
        for k, n, bias in ((256, 688, False), (5, 48, True), (1024, 16, True)):
            test_gpu_small_linear.test_matches_torch(rows, k, n, bias)
    test_gpu_small_linear.test_linear_moves_its_weight_and_back_without_changing_results()
