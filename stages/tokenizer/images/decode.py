"""Decode one ImageData into an upright RGB Pillow image, or refuse it with a 400 naming its part.

Accepted: PNG, JPEG, WebP, GIF and BMP (animated files give their first frame); anything else
is refused by name where its first bytes tell it (TIFF, SVG, HEIC, ...). Pillow is asked only
for those five formats, so no other decoder ever parses client bytes.

Invariants:
- The pixel count is checked from the header, before any pixel is decoded, against the caller's
  `max_pixels`; Pillow's own decompression-bomb error is a refusal too (its warning is silenced:
  our limit has already decided). A truncated or corrupt file is a refusal, never an exception
  that reaches the stage's loop.
- EXIF orientation is applied (`ImageOps.exif_transpose`), as transformers' `load_image` does:
  phone photos are stored sideways with an orientation tag, and the model should see what every
  viewer shows.
- Transparency is composited onto white, every other mode converted with `Image.convert("RGB")`:
  what transformers' image processors do (`image_transforms.convert_to_rgb`) to an image with
  an alpha band or a transparent palette entry. (transformers' `load_image` alone would drop
  alpha instead; the processors are what its models were trained with.)
"""

from __future__ import annotations

import io
import warnings

from PIL import Image, ImageOps

from conveyor.stages.tokenizer.rejected import Rejected
from conveyor.wire.images import ImageData

FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
_OPENED_AS = {*FORMATS, "MPO"}  # Pillow opens a JPEG with a multi-picture extension as MPO
_NAMES = "PNG, JPEG, WebP, GIF or BMP"

# First bytes of formats clients send that we refuse, for a clear message.
_SIGNATURES = (
    (b"II*\x00", "TIFF"),
    (b"MM\x00*", "TIFF"),
    (b"%PDF", "PDF"),
    (b"\x00\x00\x01\x00", "ICO"),
    (b"8BPS", "PSD"),
    (b"\xff\x0a", "JPEG XL"),
    (b"\x00\x00\x00\x0cJXL ", "JPEG XL"),
)
_FTYP_BRANDS = {b"heic": "HEIC", b"heix": "HEIC", b"mif1": "HEIF", b"avif": "AVIF", b"avis": "AVIF"}


def decode_image(image: ImageData, *, max_pixels: int) -> Image.Image:
    """The image's pixels, upright, in mode RGB; raises Rejected (param = image.part)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            opened = Image.open(io.BytesIO(image.data), formats=FORMATS)
    except Image.DecompressionBombError:
        raise _refuse(image, f"the image has more than {2 * (Image.MAX_IMAGE_PIXELS or 0)} pixels") from None
    except Exception:  # Pillow raises several types on hostile bytes; each one is the client's fault
        raise _refuse(image, _unreadable(image.data)) from None
    with opened:
        if opened.format not in _OPENED_AS:  # formats= should make this impossible; keep it checked
            raise _refuse(image, f"the image is in an unsupported format ({opened.format}); send {_NAMES}")
        width, height = opened.size
        if width * height > max_pixels:
            raise _refuse(image, f"the image has {width}x{height} = {width * height} pixels; at most {max_pixels} are allowed")
        if width < 1 or height < 1:
            raise _refuse(image, f"the image is empty ({width}x{height})")
        try:
            upright = ImageOps.exif_transpose(opened)
            return to_rgb(upright)
        except Exception:  # truncated data, a broken chunk, a bad EXIF block
            raise _refuse(image, f"cannot decode the {opened.format} image: the file is truncated or corrupt") from None


def to_rgb(image: Image.Image) -> Image.Image:
    """transformers' convert_to_rgb for a Pillow image: alpha (a band, or a palette's or tRNS
    transparency) is composited over opaque white; other modes go through convert("RGB")."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


def _unreadable(data: bytes) -> str:
    head = data[:16]
    name = next((name for magic, name in _SIGNATURES if head.startswith(magic)), None)
    if name is None and head[4:8] == b"ftyp":
        name = _FTYP_BRANDS.get(head[8:12])
    if name is None and head.lstrip().lower().startswith((b"<svg", b"<?xml")):
        name = "SVG"
    if name is not None:
        return f"the image is in an unsupported format ({name}); send {_NAMES}"
    if not data:
        return "the image is empty (0 bytes)"
    return f"cannot decode the image: it is not a valid {_NAMES} file"


def _refuse(image: ImageData, message: str) -> Rejected:
    return Rejected(f"{image.part}: {message}", param=image.part)
