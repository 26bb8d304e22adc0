"""LLaVA's and Qwen2-VL's preprocessing equal, bit for bit, to transformers' PIL-backend image
processors on the same files; the content hash; the checkpoint reading; the wire form."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import msgspec
import numpy as np
import pytest
from PIL import Image

from conveyor.stages.tokenizer.images import ImageProcessor, for_checkpoint, to_wire
from conveyor.stages.tokenizer.images.processor import DEFAULT_MAX_PIXELS
from conveyor.stages.tokenizer.preparation import Rejected
from conveyor.wire.images import ImageData, ImageInput
from tests.stages.image_files import encode, picture

transformers = pytest.importorskip("transformers")

LLAVA = {
    "architectures": ["LlavaForConditionalGeneration"],
    "model_type": "llava",
    "image_token_index": 32000,
    "vision_feature_select_strategy": "default",
    "vision_config": {"patch_size": 14, "image_size": 28},
}
QWEN2_VL = {
    "architectures": ["Qwen2VLForConditionalGeneration"],
    "model_type": "qwen2_vl",
    "image_token_id": 151655,
    "vision_config": {"patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2},
}
QWEN2_5_VL = {**QWEN2_VL, "architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl"}


def _clip(shortest: int, crop: int, *, llava_pad: bool = False):
    crop_size = {"height": crop, "width": crop}
    if llava_pad:
        return transformers.LlavaImageProcessorPil(size={"shortest_edge": shortest}, crop_size=crop_size, do_pad=True)
    return transformers.CLIPImageProcessorPil(size={"shortest_edge": shortest}, crop_size=crop_size)


def _qwen(min_pixels: int, max_pixels: int):
    return transformers.Qwen2VLImageProcessorPil(min_pixels=min_pixels, max_pixels=max_pixels)


# name -> (a transformers processor with small sizes, config.json); small sizes keep each case a few ms.
REFERENCES = {
    "clip": (lambda: _clip(30, 28), LLAVA),
    "llava-pad": (lambda: _clip(28, 28, llava_pad=True), LLAVA),
    "clip-336": (lambda: _clip(336, 336), {**LLAVA, "vision_config": {"patch_size": 14, "image_size": 336}}),
    "qwen2-vl": (lambda: _qwen(56 * 56, 28 * 28 * 16), QWEN2_VL),
    "qwen2.5-vl": (lambda: _qwen(28 * 28 * 8, 28 * 28 * 40), QWEN2_5_VL),
}

# (width, height, mode, format): non-square both ways, smaller than the crop and than min_pixels,
# larger than max_pixels, alpha, palette with a transparent entry, grayscale, JPEG and PNG.
IMAGES = [
    (97, 61, "RGB", "PNG"),
    (61, 97, "RGB", "JPEG"),
    (10, 7, "RGB", "PNG"),
    (640, 480, "RGB", "JPEG"),
    (300, 211, "RGBA", "PNG"),
    (40, 50, "LA", "PNG"),
    (45, 38, "P", "PNG"),
    (33, 44, "L", "JPEG"),
    (29, 31, "CMYK", "JPEG"),
    (57, 23, "RGB", "WEBP"),
    (28, 28, "P", "GIF"),
]


def checkpoint(root: Path, reference, config: dict, *, nested: bool = False) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    reference.save_pretrained(root)
    if nested:  # transformers 5's processor save_pretrained: the image processor inside processor_config.json
        pre = root / "preprocessor_config.json"
        (root / "processor_config.json").write_text(json.dumps({"image_processor": json.loads(pre.read_text())}))
        pre.write_text(json.dumps({"image_processor_type": "CLIPImageProcessor", "size": {"shortest_edge": 999}}))
    (root / "config.json").write_text(json.dumps(config))
    return root


@pytest.fixture(scope="module", params=sorted(REFERENCES))
def pair(request, tmp_path_factory):
    make, config = REFERENCES[request.param]
    reference = make()
    processor = for_checkpoint(checkpoint(tmp_path_factory.mktemp(request.param), reference, config))
    assert processor is not None
    return request.param, reference, processor


@pytest.mark.parametrize("width,height,mode,fmt", IMAGES)
def test_pixels_equal_transformers(pair, width, height, mode, fmt):
    name, reference, processor = pair
    data = encode(picture(width, height, mode, seed=width), fmt)
    mine = processor.process(ImageData(data, "messages[0].content[0]"))
    theirs = reference(Image.open(io.BytesIO(data)), return_tensors="np")
    expected = theirs["pixel_values"]
    assert mine.pixels.dtype == np.float32 and mine.pixels.flags.c_contiguous
    if name.startswith("qwen"):
        grid = tuple(int(v) for v in theirs["image_grid_thw"][0])
        assert mine.grid == grid
        assert mine.num_tokens == grid[0] * grid[1] * grid[2] // reference.merge_size**2
    else:
        expected = expected[0]
        crop = reference.crop_size["height"]
        assert mine.grid == () and mine.num_tokens == (crop // 14) ** 2
    assert mine.shape == expected.shape
    np.testing.assert_array_equal(mine.pixels, expected)  # the same float32 bits, not just close


def test_full_feature_strategy_counts_the_cls_token(tmp_path):
    reference = transformers.CLIPImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
    config = {**LLAVA, "vision_feature_select_strategy": "full"}
    processor = for_checkpoint(checkpoint(tmp_path, reference, config))
    assert processor is not None
    assert processor.process(ImageData(encode(picture(40, 30), "PNG"), "p")).num_tokens == 2 * 2 + 1


def test_the_nested_processor_config_wins_as_in_transformers(tmp_path):
    make, config = REFERENCES["clip"]
    processor = for_checkpoint(checkpoint(tmp_path, make(), config, nested=True))
    assert processor is not None
    assert processor.process(ImageData(encode(picture(50, 40), "PNG"), "p")).shape == (3, 28, 28)


def test_checkpoints_without_a_vision_family_get_none(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    assert for_checkpoint(tmp_path) is None


def test_model_type_alone_picks_the_family_and_the_token_id(tmp_path):
    make, config = REFERENCES["qwen2-vl"]
    config = {k: v for k, v in config.items() if k != "architectures"}
    processor = for_checkpoint(checkpoint(tmp_path, make(), config))
    assert isinstance(processor, ImageProcessor)
    assert processor.image_token_id == 151655 and processor.max_pixels == DEFAULT_MAX_PIXELS


def test_a_preprocessor_that_disagrees_with_the_tower_fails_at_start(tmp_path):
    make, config = REFERENCES["qwen2-vl"]
    config = {**config, "vision_config": {**config["vision_config"], "spatial_merge_size": 4}}
    with pytest.raises(ValueError, match="spatial_merge_size"):
        for_checkpoint(checkpoint(tmp_path, make(), config))


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    make, config = REFERENCES["qwen2-vl"]
    return for_checkpoint(checkpoint(tmp_path_factory.mktemp("qwen"), make(), config), max_pixels=500 * 500)


def test_the_hash_follows_the_pixels_not_the_encoding(qwen):
    image = picture(90, 70, seed=3)
    hashes = {
        fmt: qwen.process(ImageData(encode(image, fmt, **opts), "p")).hash
        for fmt, opts in [("PNG", {}), ("BMP", {}), ("WEBP", {"lossless": True}), ("PNG", {"compress_level": 0})]
    }
    assert len(set(hashes.values())) == 1
    assert -(2**63) <= hashes["PNG"] < 2**63
    other = qwen.process(ImageData(encode(picture(90, 70, seed=4), "PNG"), "p")).hash
    assert other != hashes["PNG"]
    one_pixel = np.asarray(image).copy()
    one_pixel[35, 45, 0] ^= 0x40
    assert qwen.process(ImageData(encode(Image.fromarray(one_pixel), "PNG"), "p")).hash != hashes["PNG"]


def test_the_hash_tells_grids_apart_when_the_bytes_match(qwen):
    # A plain image makes identical patches; only the grid tells 56 x 112 from 112 x 56.
    wide = qwen.process(ImageData(encode(Image.new("RGB", (112, 56), "white"), "PNG"), "p"))
    tall = qwen.process(ImageData(encode(Image.new("RGB", (56, 112), "white"), "PNG"), "p"))
    assert wide.shape == tall.shape and wide.pixels.tobytes() == tall.pixels.tobytes()
    assert wide.grid != tall.grid and wide.hash != tall.hash


def test_the_hash_changes_with_the_settings_and_not_between_processes(tmp_path):
    data = ImageData(encode(picture(90, 70), "PNG"), "p")
    config = REFERENCES["clip"][1]
    plain = for_checkpoint(checkpoint(tmp_path / "a", _clip(30, 28), config))
    again = for_checkpoint(checkpoint(tmp_path / "b", _clip(30, 28), config))
    shifted = transformers.CLIPImageProcessorPil(
        size={"shortest_edge": 30}, crop_size={"height": 28, "width": 28}, image_mean=[0.5, 0.5, 0.5]
    )
    other = for_checkpoint(checkpoint(tmp_path / "c", shifted, config))
    assert plain is not None and again is not None and other is not None
    first, second, third = (p.process(data) for p in (plain, again, other))
    assert first.hash == second.hash
    assert first.shape == third.shape and not np.array_equal(first.pixels, third.pixels)
    assert first.hash != third.hash


def test_refusals_name_the_part(qwen):
    for data, words in [
        (b"GIF87a-broken", "not a valid"),
        (encode(picture(600, 500), "PNG"), "at most 250000"),
        (encode(picture(402, 2), "PNG"), "200 times"),
    ]:
        with pytest.raises(Rejected, match=words) as caught:
            qwen.process(ImageData(data, "input[0].content[3]"))
        assert caught.value.param == "input[0].content[3]"


def test_to_wire_round_trips_through_msgspec(qwen):
    processed = qwen.process(ImageData(encode(picture(80, 60), "PNG"), "p"))
    wire = to_wire(processed, offset=17)
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(wire), type=ImageInput)
    assert (back.hash, back.offset, back.length) == (processed.hash, 17, processed.num_tokens)
    assert back.shape == list(processed.shape) and back.grid == list(processed.grid)
    pixels = np.frombuffer(back.pixels, dtype="<f4").reshape(back.shape)
    assert np.array_equal(pixels, processed.pixels)


def test_the_package_imports_neither_torch_nor_transformers():
    code = (
        "import sys, conveyor.stages.tokenizer.images\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'transformers', 'torchvision'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
