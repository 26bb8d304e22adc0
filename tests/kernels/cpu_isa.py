"""The ISA variants (gpu/backends/cpu/kernels/isa.py) a C++ kernel's tests build and check here.

`variant_params(int8)` gives one pytest param per variant: skipped where this CPU lacks one of
its features; marked slow where it compiles the same paths (isa.kernel_paths: the int8 products
where `int8`, else the float vectors' width alone) as a variant before it in the table, native
first, so that the default run checks each path this CPU can run once, and `-m slow` every build.
"""

from __future__ import annotations

import pytest

from conveyor.gpu.backends.cpu.kernels import isa


def variant_params(int8: bool) -> list:
    params: list = []
    seen: set = set()
    for name, variant in isa.VARIANTS.items():
        missing = isa.missing_features(variant)
        if missing is None or missing:
            reason = f"this CPU lacks {', '.join(missing)}" if missing else "this CPU's features cannot be read"
            params.append(pytest.param(name, marks=pytest.mark.skip(reason=f"{name}: {reason}")))
            continue
        paths = isa.kernel_paths(isa.build_features(variant))
        key = paths if int8 else paths.float_lanes
        params.append(pytest.param(name, marks=pytest.mark.slow) if key in seen else name)
        seen.add(key)
    return params
