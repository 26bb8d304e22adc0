"""Qwen2-VL's and Qwen2.5-VL's vision tower (gpu/models/vision/qwen2_vl.py) against transformers'.

Tiny configs built with transformers' own Qwen2VLConfig / Qwen2_5_VLConfig, the whole model
random-initialized with a fixed seed at unit scale (HF's 0.02 init makes attention near uniform, so
a wrong position or window would hardly show), pixels from transformers' PIL image processor on
small images of different sizes. Our `encode` must equal `get_image_features` per image (float32),
one image at a time and several in one call, loaded from the module names (`model.visual.*`) and
from the saved files (`visual.*`). The Qwen2.5-VL tower has windows of 2x2 merge units and a
full-attention layer between windowed ones, with images whose unit grids are not multiples of 2,
so cut-short windows occur.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from conveyor.config import ConfigError
from conveyor.gpu.models.vision.qwen2_vl import Qwen2VisionTower, qwen2_vl_vision_config
from conveyor.gpu.models.vision.segments import window_segments

transformers = pytest.importorskip("transformers")

TEXT = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "bos_token_id": 0,
    "eos_token_id": 1,
}
COMMON = {"num_heads": 4, "patch_size": 14, "temporal_patch_size": 2, "spatial_merge_size": 2}
QWEN2_VL = {**COMMON, "depth": 3, "embed_dim": 48, "hidden_size": 64}
QWEN2_5_VL = {
    **COMMON,
    "depth": 4,
    "hidden_size": 48,
    "intermediate_size": 80,
    "out_hidden_size": 64,
    "window_size": 56,  # 56 / 14 / 2 = 2 merge units a side
    "fullatt_block_indexes": [1],
}
SIZES = [(84, 56), (112, 168), (60, 50)]  # (width, height): patch grids 4x6, 12x8 (cut windows), 4x4


def picture(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def pixels_of(*images: Image.Image) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' preprocessing (its PIL backend): pixels [patches, 3*2*14*14], grids [n, 3]."""
    processor = transformers.Qwen2VLImageProcessorPil(
        size={"shortest_edge": 28 * 28, "longest_edge": 28 * 28 * 40}, patch_size=14, merge_size=2, temporal_patch_size=2
    )
    out = processor(list(images), return_tensors="pt")
    return out["pixel_values"], out["image_grid_thw"]


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Unit-scale weights: matrices ~ N(0, 1/fan_in), norms 1 + N(0, 0.1^2), biases N(0, 0.1^2)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            draw = torch.randn(p.shape, generator=gen)
            if p.dim() > 1:
                p.copy_(draw / p[0].numel() ** 0.5)
            elif "norm" in name or "ln_q" in name:
                p.copy_(1 + 0.1 * draw)
            else:
                p.copy_(0.1 * draw)


def make(kind: str, tmp: Path):
    """(transformers' model, its saved directory) for "qwen2_vl" or "qwen2_5_vl"."""
    torch.manual_seed(0)
    if kind == "qwen2_vl":
        config = transformers.Qwen2VLConfig(vision_config=QWEN2_VL, text_config=TEXT)
        model = transformers.Qwen2VLForConditionalGeneration(config)
    else:
        config = transformers.Qwen2_5_VLConfig(vision_config=QWEN2_5_VL, text_config=TEXT)
        model = transformers.Qwen2_5_VLForConditionalGeneration(config)
    randomize(model, seed=1)
    model.save_pretrained(tmp)
    return model.eval(), tmp


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def pair(request, tmp_path_factory):
    """(transformers' model, ours loaded from its module names, the saved directory)."""
    hf, path = make(request.param, tmp_path_factory.mktemp(request.param))
    config = qwen2_vl_vision_config(json.loads((path / "config.json").read_text()))
    ours = Qwen2VisionTower(config).eval()
    ours.load_weights(hf.state_dict().items())
    return hf, ours, path


def hf_features(hf, pixels: torch.Tensor, grids: torch.Tensor) -> list[torch.Tensor]:
    with torch.no_grad():
        return list(hf.model.get_image_features(pixel_values=pixels, image_grid_thw=grids).pooler_output)


def encode(ours: Qwen2VisionTower, pixels: torch.Tensor, grids: torch.Tensor) -> list[torch.Tensor]:
    with torch.no_grad():
        return ours.encode(pixels, grids.tolist())


def test_the_config_reads_both_towers(pair):
    hf, ours, path = pair
    c, v = ours.config, hf.config.vision_config
    assert c.tower == hf.config.model_type
    assert (c.num_layers, c.num_heads, c.patch_size, c.spatial_merge_size, c.temporal_patch_size) == (
        v.depth,
        v.num_heads,
        14,
        2,
        2,
    )
    assert c.out_hidden_size == TEXT["hidden_size"]
    if c.tower == "qwen2_vl":
        assert (c.hidden_size, c.intermediate_size, c.hidden_act, c.window_size) == (48, 192, "quick_gelu", 0)
    else:
        assert (c.hidden_size, c.intermediate_size, c.hidden_act) == (48, 80, "silu")
        assert (c.window_size, c.full_attention_layers) == (56, (1,))


def test_the_hub_config_json_layout_is_read():
    """Qwen2-VL-7B-Instruct's vision_config as the Hub ships it: in_chans, no hidden_act."""
    hub = {
        "model_type": "qwen2_vl",
        "image_token_id": 151655,
        "vision_config": {"depth": 32, "embed_dim": 1280, "mlp_ratio": 4, "num_heads": 16, "in_chans": 3, "hidden_size": 3584}
        | {"patch_size": 14, "spatial_merge_size": 2, "spatial_patch_size": 14, "temporal_patch_size": 2},
    }
    c = qwen2_vl_vision_config(hub)
    assert (c.hidden_size, c.intermediate_size, c.out_hidden_size, c.hidden_act) == (1280, 5120, 3584, "quick_gelu")
    with pytest.raises(ConfigError, match="llava"):
        qwen2_vl_vision_config({**hub, "model_type": "llava"})


def test_one_image_at_a_time_equals_transformers(pair):
    hf, ours, _ = pair
    for i, (w, h) in enumerate(SIZES):
        pixels, grids = pixels_of(picture(w, h, seed=i))
        (want,) = hf_features(hf, pixels, grids)
        (got,) = encode(ours, pixels, grids)
        t, gh, gw = grids[0].tolist()
        assert got.shape == (t * gh * gw // 4, TEXT["hidden_size"]) == want.shape
        assert want.abs().max() > 0.1  # weights that carry a signal
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_several_images_in_one_call_equal_transformers(pair):
    hf, ours, _ = pair
    pixels, grids = pixels_of(*(picture(w, h, seed=10 + i) for i, (w, h) in enumerate(SIZES)))
    want = hf_features(hf, pixels, grids)
    got = encode(ours, pixels, grids)
    assert len(got) == len(want) == len(SIZES)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    # an image's embeddings do not depend on its neighbours in the call
    (alone,) = encode(ours, *pixels_of(picture(*SIZES[1], seed=11)))
    torch.testing.assert_close(got[1], alone, atol=1e-5, rtol=1e-5)


def test_the_saved_files_load_by_their_names(pair):
    """save_pretrained writes the Hub's `visual.*` names; they load to the same tower."""
    hf, ours, path = pair
    tensors = load_file(path / "model.safetensors")
    assert any(name.startswith("visual.") for name in tensors)
    again = Qwen2VisionTower(ours.config).eval()
    again.load_weights(tensors.items(), str(path))
    pixels, grids = pixels_of(picture(*SIZES[1], seed=5))
    torch.testing.assert_close(encode(again, pixels, grids), encode(ours, pixels, grids), atol=0, rtol=0)
    with pytest.raises(ConfigError, match="lacks"):
        Qwen2VisionTower(ours.config).load_weights(((k, v) for k, v in tensors.items() if "merger" not in k), str(path))


def test_another_image_changes_the_output(pair):
    _, ours, _ = pair
    (a,) = encode(ours, *pixels_of(picture(*SIZES[1], seed=20)))
    (b,) = encode(ours, *pixels_of(picture(*SIZES[1], seed=21)))
    assert (a - b).abs().max() > 1e-2


def test_windows_tile_each_frame_and_cut_the_last_ones_short():
    """A 6x4-unit grid (12x8 patches) in 2x2-unit windows: 3 x 2 windows of 16 rows; a 3x3-unit
    grid: one 2x2 window, two cut to 2 units and one to 1; every row in exactly one window."""
    full = window_segments([(1, 12, 8)], merge=2, side=2, device=torch.device("cpu"))
    assert full.index.shape == (6, 16) and bool(full.valid.all()) and full.mask is None
    first = full.index[0].view(4, 4)[:, 0].tolist()  # the units 0, 1 (row 0) and 4, 5 (row 1)
    assert first == [0, 4, 16, 20]
    cut = window_segments([(1, 6, 6)], merge=2, side=2, device=torch.device("cpu"))
    assert cut.valid.sum(1).tolist() == [16, 8, 8, 4] and cut.mask is not None
    rows = cut.index[cut.valid]
    assert sorted(rows.tolist()) == list(range(36))
