"""decode_image: the five accepted formats to upright RGB, and a 400 naming the part for the rest."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from conveyor.stages.tokenizer.images import decode_image
from conveyor.stages.tokenizer.preparation import Rejected
from conveyor.wire.images import ImageData
from tests.stages.image_files import encode, picture

PART = "messages[1].content[2]"
BIG = 10**12  # no pixel limit, for the tests that are about something else


def decode(data: bytes, max_pixels: int = BIG) -> Image.Image:
    return decode_image(ImageData(data, PART), max_pixels=max_pixels)


def refusal(data: bytes, max_pixels: int = BIG) -> str:
    with pytest.raises(Rejected) as caught:
        decode(data, max_pixels)
    assert caught.value.param == PART
    assert str(caught.value).startswith(PART + ": ")
    return str(caught.value)


@pytest.mark.parametrize("fmt", ["PNG", "BMP", "GIF", ("WEBP", {"lossless": True})])
def test_lossless_formats_decode_to_the_same_pixels(fmt):
    fmt, options = fmt if isinstance(fmt, tuple) else (fmt, {})
    image = picture(23, 17).quantize(64).convert("RGB") if fmt == "GIF" else picture(23, 17)  # GIF: 256 colours
    decoded = decode(encode(image, fmt, **options))
    assert decoded.mode == "RGB" and decoded.size == (23, 17)
    assert np.array_equal(np.asarray(decoded), np.asarray(image))


def test_jpeg_and_lossy_webp_decode_to_rgb_of_their_size():
    for data in (encode(picture(31, 12), "JPEG"), encode(picture(31, 12), "WEBP", quality=50)):
        decoded = decode(data)
        assert decoded.mode == "RGB" and decoded.size == (31, 12)


def test_cmyk_and_grayscale_jpegs_become_rgb_as_pillow_converts_them():
    for mode in ("CMYK", "L"):
        data = encode(picture(9, 8, mode), "JPEG")
        expected = Image.open(io.BytesIO(data)).convert("RGB")
        assert np.array_equal(np.asarray(decode(data)), np.asarray(expected))


def test_an_animated_gif_gives_its_first_frame():
    red, blue = Image.new("RGB", (6, 4), (255, 0, 0)), Image.new("RGB", (6, 4), (0, 0, 255))
    data = encode(red, "GIF", save_all=True, append_images=[blue], duration=100)
    assert np.asarray(decode(data))[0, 0].tolist() == [255, 0, 0]


def test_transparency_is_composited_on_white():
    rgba = np.zeros((2, 3, 4), dtype=np.uint8)
    rgba[0, 0] = (0, 0, 0, 0)  # fully transparent black: white
    rgba[0, 1] = (0, 0, 0, 255)  # opaque black: black
    rgba[0, 2] = (0, 0, 0, 128)  # half: grey, nearer the white side by one step of rounding
    decoded = np.asarray(decode(encode(Image.fromarray(rgba, "RGBA"), "PNG")))
    assert decoded[0, 0].tolist() == [255, 255, 255]
    assert decoded[0, 1].tolist() == [0, 0, 0]
    assert 120 <= decoded[0, 2, 0] <= 130
    palette = picture(8, 8, "P")
    assert Image.open(io.BytesIO(encode(palette, "PNG"))).info.get("transparency") == 0
    clear = np.asarray(palette) == 0
    assert clear.any()
    assert (np.asarray(decode(encode(palette, "PNG")))[clear] == 255).all()


def test_exif_orientation_is_applied():
    stored = picture(4, 2)
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 degrees clockwise to display"
    decoded = decode(encode(stored, "PNG", exif=exif))
    assert decoded.size == (2, 4)
    assert np.array_equal(np.asarray(decoded), np.asarray(stored.transpose(Image.Transpose.ROTATE_270)))


def test_bytes_that_are_no_image_are_refused():
    assert "not a valid PNG, JPEG, WebP, GIF or BMP" in refusal(b"definitely not an image")
    assert "empty" in refusal(b"")


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "GIF", "WEBP"])
def test_a_truncated_file_is_refused(fmt):
    data = encode(picture(64, 48), fmt)
    message = refusal(data[: len(data) // 2])
    assert "truncated or corrupt" in message or "not a valid" in message


def test_unsupported_formats_are_refused_by_name():
    assert "(TIFF)" in refusal(encode(picture(5, 5), "TIFF"))
    assert "(ICO)" in refusal(encode(picture(16, 16), "ICO"))
    svg = b'<?xml version="1.0"?><svg xmlns="http://www.w3.org/2000/svg" width="4" height="4"/>'
    assert "(SVG)" in refusal(svg)
    assert "(SVG)" in refusal(b"  <svg width='1' height='1'></svg>")
    assert "not a valid" in refusal(encode(picture(5, 5), "PPM"))  # no signature we name: still refused


def _png_header_only(width: int, height: int) -> bytes:
    """A PNG that declares width x height and holds a few bytes of pixel data."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\x00" * 64)) + chunk(b"IEND", b"")


def test_too_many_pixels_are_refused_from_the_header():
    # 10000 x 10000 RGB would be 300 MB decoded (and sets off only Pillow's warning): refused
    # before any pixel is, since the file holds almost none.
    message = refusal(_png_header_only(10_000, 10_000), max_pixels=4096 * 4096)
    assert "10000x10000" in message and str(4096 * 4096) in message
    assert decode(encode(picture(64, 64), "PNG"), max_pixels=64 * 64).size == (64, 64)
    assert "at most 4095" in refusal(encode(picture(64, 64), "PNG"), max_pixels=4095)


def test_a_decompression_bomb_is_refused():
    bomb = encode(Image.new("L", (4000, 4000)), "PNG")  # 16M pixels in a file of a few KB
    assert len(bomb) < 64 * 1024
    assert "16000000 pixels" in refusal(bomb, max_pixels=1024 * 1024)
    # With no limit of ours, Pillow's own bomb check (over 2 x MAX_IMAGE_PIXELS) still refuses.
    assert "more than" in refusal(_png_header_only(100_000, 100_000), max_pixels=BIG)
