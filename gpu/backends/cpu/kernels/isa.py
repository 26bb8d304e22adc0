"""The instruction-set variants the C++ CPU kernels are built in, and the CPU this process runs on.

A variant is a name (CONVEYOR_CPU_ISA, config/env.py; default `native`), the -march flags build.py
compiles with, and the CPU features (as /proc/cpuinfo names them) those flags let the compiler
use, so a CPU must have every one of them to run the build: build.py refuses a variant whose
features this CPU lacks (an illegal instruction would kill the process, not raise). `native` is
the CPU's own features, AMX included where it has them. Imports no torch (its package does).

Which path each variant compiles follows from its features through the kernels' #if guards,
mirrored by `kernel_paths` (tests/kernels/test_cpu_isa_variants.py checks the table against the
compiler's macros and the built library's instructions):

  variant               float vectors   int8 byte products (quant_int8_isa.h)
  native                the CPU's       the CPU's (the row below with its features)
  x86-64-v3              8 lanes (ymm)  vpmaddubsw + vpmaddwd, ymm (u8 codes shifted by 128)
  x86-64-v3-vnni         8 lanes (ymm)  vpdpbusd, AVX-VNNI, ymm
  x86-64-v4             16 lanes (zmm)  vpmaddubsw + vpmaddwd, zmm (u8 codes shifted by 128)
  x86-64-v4-vnni-bf16   16 lanes (zmm)  vpdpbusd, AVX512-VNNI, zmm

No kernel has AVX512-BF16 or AMX code (they take float32), so -mavx512bf16 and native's AMX
change no path today; the variants name them because the machines users have do.
"""

from __future__ import annotations

import dataclasses
import functools
import platform
from pathlib import Path

from conveyor.config import env

# x86-64 micro-architecture levels (the psABI's), as /proc/cpuinfo spells the features:
# pni is SSE3, abm carries LZCNT.
_V2 = frozenset({"cx16", "lahf_lm", "popcnt", "pni", "sse4_1", "sse4_2", "ssse3"})
_V3 = _V2 | {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"}
_V4 = _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}

# The features the kernels' #if guards test (vector_math.h, quant_decode.h, quant_int8_isa.h,
# quant_linear.cpp, small_linear.cpp), with the macro the compiler defines for each; BF16 and
# AMX for the record (no guard tests them).
GUARDS = {
    "avx2": "__AVX2__",
    "f16c": "__F16C__",
    "avx512f": "__AVX512F__",
    "avx512bw": "__AVX512BW__",
    "avx512vl": "__AVX512VL__",
    "avx512_vnni": "__AVX512VNNI__",
    "avx_vnni": "__AVXVNNI__",
    "avx512_bf16": "__AVX512BF16__",
    "amx_tile": "__AMX_TILE__",
}


@dataclasses.dataclass(frozen=True)
class IsaVariant:
    name: str
    flags: tuple[str, ...]  # the compiler's target flags, in place of -march=native
    features: frozenset[str] | None  # what the CPU must have; None: the CPU's own (native)
    # oneDNN's ONEDNN_MAX_CPU_ISA for the same restriction (its GEMMs serve the cpu backend's
    # many-row products, onednn_linear.py); None: oneDNN's own pick (native)
    onednn: str | None = None


VARIANTS = {  # native, then the levels from the oldest up
    v.name: v
    for v in (
        IsaVariant("native", ("-march=native",), None),
        IsaVariant("x86-64-v3", ("-march=x86-64-v3",), _V3, "AVX2"),
        IsaVariant("x86-64-v3-vnni", ("-march=x86-64-v3", "-mavxvnni"), _V3 | {"avx_vnni"}, "AVX2_VNNI"),
        IsaVariant("x86-64-v4", ("-march=x86-64-v4",), _V4, "AVX512_CORE"),
        IsaVariant(
            "x86-64-v4-vnni-bf16",
            ("-march=x86-64-v4", "-mavx512vnni", "-mavx512bf16"),
            _V4 | {"avx512_vnni", "avx512_bf16"},
            "AVX512_CORE_BF16",
        ),
    )
}


# The byte products without VNNI: vpmaddubsw's 16-bit pair sums saturate, so u8 codes are taken
# as code - 128 (quant_int8.h).
_MADDUBS, _SHIFTED = "vpmaddubsw + vpmaddwd, ", " (u8 codes shifted by 128)"


@dataclasses.dataclass(frozen=True)
class KernelPaths:
    """What a build with `features` runs: float32 vectors of `float_lanes` (0: the compiler's
    generic vectors, no x86 intrinsics) and the int8 path's byte products (None: no int8 path;
    the quantized linear's int8 requests take the float decode)."""

    float_lanes: int
    int8: str | None

    def __str__(self) -> str:
        floats = f"float32 vectors of {self.float_lanes} lanes" if self.float_lanes else "generic float vectors"
        return f"{floats}, int8 products by {self.int8 or 'none (float decode)'}"


def kernel_paths(features: frozenset[str]) -> KernelPaths:
    """The kernels' #if guards, applied to a build's features."""
    if "avx2" not in features:
        return KernelPaths(0, None)
    if {"avx512f", "avx512bw"} <= features:  # quant_int8_isa.h's 512-bit branch
        vnni = "avx512_vnni" in features
        return KernelPaths(16, "vpdpbusd (AVX512-VNNI, zmm)" if vnni else _MADDUBS + "zmm" + _SHIFTED)
    lanes = 16 if "avx512f" in features else 8  # vector_math.h tests F alone
    if {"avx512_vnni", "avx512vl"} <= features:
        return KernelPaths(lanes, "vpdpbusd (AVX512-VNNI, ymm)")
    if "avx_vnni" in features:
        return KernelPaths(lanes, "vpdpbusd (AVX-VNNI, ymm)")
    return KernelPaths(lanes, _MADDUBS + "ymm" + _SHIFTED)


def variant(name: str) -> IsaVariant:
    """The variant `name`; ValueError naming the others where there is none."""
    if name not in VARIANTS:
        raise ValueError(f"unknown CPU ISA variant {name!r} (CONVEYOR_CPU_ISA): one of {', '.join(VARIANTS)}")
    return VARIANTS[name]


def missing_features(v: IsaVariant) -> list[str] | None:
    """The features `v` needs that this CPU lacks ([]: it runs here); None where this CPU's
    features cannot be read (no /proc/cpuinfo) and `v` is not native."""
    if v.features is None:
        return []
    have = cpu_features()
    return None if have is None else sorted(v.features - have)


def check_runs_here(v: IsaVariant) -> None:
    """RuntimeError, with the reason, where this CPU cannot run a build of `v`."""
    missing = missing_features(v)
    if missing is None:
        raise RuntimeError(f"cannot read this CPU's features (no /proc/cpuinfo) to check {v.name}: use native")
    if missing:
        raise RuntimeError(f"this CPU ({cpu_model()}) lacks {', '.join(missing)}, which {v.name} needs")


def runnable() -> list[str]:
    """The variants this CPU can run, native first."""
    return [name for name, v in VARIANTS.items() if missing_features(v) == []]


def build_features(v: IsaVariant) -> frozenset[str]:
    """The features a build of `v` compiles for: native's are the CPU's."""
    return v.features if v.features is not None else cpu_features() or frozenset()


def describe(name: str) -> str:
    """One line for logs and benchmark tables: the CPU, the variant and the paths it runs."""
    try:
        v = variant(name)
        check_runs_here(v)
    except (ValueError, RuntimeError) as e:
        return f"{cpu_model()}; kernels for {name} refused ({e}), torch paths instead"
    return f"{cpu_model()}; kernels built for {name} ({' '.join(v.flags)}): {kernel_paths(build_features(v))}"


def describe_in_use() -> str:
    """`describe` of the variant CONVEYOR_CPU_ISA picks: what the cpu backend logs at start-up
    and `conveyor bench` prints beside its tables."""
    return describe(env.cpu_isa())


def cpu_model() -> str:
    """The CPU's name as the OS tells it, with its x86 family and model: a cloud guest's name is
    often the vendor's alone ("Intel(R) Xeon(R) Processor (family 6, model 207)", an Emerald Rapids;
    "AMD EPYC (family 26, model 2)", a Zen 5), and figures differ by micro-architecture."""
    info = _cpuinfo()
    name = info.get("model name") or platform.processor() or platform.machine() or "unknown CPU"
    family, model = info.get("cpu family"), info.get("model")
    return f"{name} (family {family}, model {model})" if family and model else name


def cpu_features() -> frozenset[str] | None:
    """The CPU's feature flags (x86 "flags", Arm "Features"); None without /proc/cpuinfo."""
    info = _cpuinfo()
    line = info.get("flags", info.get("Features"))
    return None if line is None else frozenset(line.split())


@functools.cache
def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo; {} where there is none."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    fields: dict[str, str] = {}
    for line in text.split("\n\n", 1)[0].splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())
    return fields
