"""MediaConfig (config/media.py): --limit-mm-per-prompt in vLLM's forms, the host list's checks,
the flags `conveyor serve` derives from it, and accepts_images, False unless the build says so."""

from __future__ import annotations

import argparse

import pytest

from conveyor import cli
from conveyor.config import ConfigError, EngineConfig, MediaConfig, accepts_images, config_from_json, config_to_json
from conveyor.config.engine_options import OPTION_CLASSES
from conveyor.config.media import DEFAULT_MAX_IMAGES, image_limit
from conveyor.config.options import collect, settings


@pytest.mark.parametrize(
    "text, images",
    [
        ('{"image": 2}', 2),
        ('{"image": 0}', 0),
        ('{"image": 3, "video": 1}', 3),  # vLLM's other modalities: accepted, ignored
        ('{"image": {"count": 5, "width": 512, "height": 512}}', 5),  # vLLM's newer form
        ('{"video": 0}', DEFAULT_MAX_IMAGES),  # images left out keep the default
        ("image=4,video=0", 4),  # vLLM's older form
        ("{}", DEFAULT_MAX_IMAGES),
    ],
)
def test_limit_mm_per_prompt_takes_vllms_forms(text, images):
    assert image_limit(text) == images
    assert MediaConfig(limit_mm_per_prompt=text).max_images == images


@pytest.mark.parametrize(
    "text, words",
    [
        ('{"images": 2}', "unknown modality 'images'"),
        ('{"image": -1}', "count of 0 or more"),
        ('{"image": 1.5}', "count of 0 or more"),
        ('{"image": true}', "count of 0 or more"),
        ("[2]", "JSON object"),
        ("two", "give JSON"),
        ("image=x", "count of 0 or more"),
    ],
)
def test_limit_mm_per_prompt_refuses_what_it_cannot_read(text, words):
    with pytest.raises(ConfigError, match="--limit-mm-per-prompt") as e:
        MediaConfig(limit_mm_per_prompt=text)
    assert words in str(e.value)


@pytest.mark.parametrize("domain", ["https://example.com", "example.com:8080", "example.com/images", "", ".example.com"])
def test_allowed_media_domains_are_host_names(domain):
    with pytest.raises(ConfigError, match="--allowed-media-domains"):
        MediaConfig(allowed_media_domains=(domain,))
    assert MediaConfig(allowed_media_domains=("example.com", "10.0.0.5", "::1")).allowed_media_domains[2] == "::1"  # addresses too


def test_the_flags_and_their_defaults():
    assert MediaConfig in OPTION_CLASSES.values()  # `conveyor serve` and LLM(...) take them
    parser = argparse.ArgumentParser()
    cli.serve_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(
        [
            "serve",
            "--limit-mm-per-prompt",
            '{"image": 2}',
            "--allowed-media-domains",
            "example.com",
            "cdn.example.org",
            "--max-image-bytes",
            "1000",
            "--media-fetch-timeout",
            "2.5",
            "--max-image-pixels",
            "4096",
        ]
    )
    fields = collect((MediaConfig,), {s.name: getattr(args, s.name) for s in settings(MediaConfig)})
    media = MediaConfig(**fields[MediaConfig])
    assert media == MediaConfig(
        limit_mm_per_prompt='{"image": 2}',
        allowed_media_domains=("example.com", "cdn.example.org"),
        max_image_bytes=1000,
        media_fetch_timeout_s=2.5,
        max_image_pixels=4096,
    )
    defaults = MediaConfig()
    assert (defaults.max_images, defaults.allowed_media_domains, defaults.max_image_bytes) == (16, (), 20 * 1024 * 1024)
    assert (defaults.media_fetch_timeout_s, defaults.max_image_pixels, defaults.model_accepts_images) == (10.0, 8192 * 8192, False)
    with pytest.raises(ConfigError, match="--max-image-bytes must be positive"):
        collect((MediaConfig,), {"max_image_bytes": 0})


def test_accepts_images_is_false_unless_the_model_config_says_so(tmp_path):
    from tests.ingress_server import make_config

    config = make_config(tmp_path, str(tmp_path))
    assert not accepts_images(config)
    vision = config.replace(media=MediaConfig(model_accepts_images=True))
    assert accepts_images(vision)
    back: EngineConfig = config_from_json(config_to_json(vision))  # every stage reads it back from the run directory
    assert back.media == vision.media and accepts_images(back)


def test_a_vision_model_takes_bodies_large_enough_for_a_photo(tmp_path):
    """Base64 images ride in the body: a vision model's cap is 32 MiB, a text model's stays 4 MiB."""
    from conveyor.config.engine import VISION_BODY_BYTES
    from conveyor.engine_config import build_engine_config
    from conveyor.tiny.checkpoint import ensure_default_model
    from conveyor.tiny.vision import make_llava

    vision = build_engine_config(str(make_llava(tmp_path / "llava")), device="cpu")
    text = build_engine_config(str(ensure_default_model()), device="cpu")
    assert vision.server.max_body_bytes == VISION_BODY_BYTES > text.server.max_body_bytes == 4 * 1024 * 1024
    assert accepts_images(vision) and not accepts_images(text)
