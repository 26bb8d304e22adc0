"""conveyor/sim/gemm_roofline.py: the issue-29 estimates follow from their formula and the shapes
they name are the models' own."""

from __future__ import annotations

import pytest

from conveyor.gpu.emulated.devices import DEVICES
from conveyor.sim.gemm_roofline import FORMATS, MODELS, estimate, main

H100 = DEVICES["h100"]


@pytest.mark.parametrize(("name", "bits"), [("bf16", 16), ("W8A16 g128", 8.25), ("W4A16 g128", 4.25), ("W4A16 g32", 5.0)])
def test_bits_per_weight_count_the_scales_and_mins(name, bits):
    n = k = 4096
    assert FORMATS[name].weight_bytes(n, k) * 8 / (n * k) == bits


def test_a_product_is_as_slow_as_its_slower_side():
    w4 = FORMATS["W4A16 g128"]
    decode = estimate(H100, w4, 1, 4096, 4096)
    assert decode.bound == "memory" and decode.seconds == decode.num_bytes / 3.35e12
    assert decode.num_bytes == 4096 * 4096 * 4.25 / 8 + 2 * 4096 + 2 * 4096  # the weight, x and y in bf16
    # The ridge: 989e12 / 3.35e12 FLOP a byte, at 4.25 bits a weight, is about 78 rows.
    assert estimate(H100, w4, 64, 4096, 4096).bound == "memory" and estimate(H100, w4, 96, 4096, 4096).bound == "compute"
    fp8 = estimate(H100, FORMATS["FP8 W8A8"], 512, 4096, 4096)
    assert fp8.compute_s == 2 * 512 * 4096 * 4096 / 1979e12


def test_llama3_8b_shapes_add_up_to_its_parameters():
    """8.03e9 parameters: the layers' products, the head, and the embedding (untied), as
    docs/benchmarks.md's Llama-3-8B-shaped checkpoint."""
    shapes, layers, (vocab, hidden) = MODELS["Llama-3-8B"]
    total = layers * sum(n * k for n, k in shapes) + 2 * vocab * hidden
    assert round(total / 1e9, 2) == 8.03


def test_main_prints_the_tables_as_estimates(capsys):
    main([])
    out = capsys.readouterr().out
    assert out.startswith("ESTIMATES: h100")
    assert "| Llama-3-8B, h100, all linear layers of a step |" in out and "| W4A16 g128 | 4,763 | 1,422 us |" in out
