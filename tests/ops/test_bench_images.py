"""conveyor bench serve's images (--image-fraction, --images-per-request, --image-size,
--image-repeat-fraction): which requests carry pictures and which repeat, that the same seed
gives the same requests, that every picture is a JPEG of the asked size in a valid data: URL,
and what reaches a fake server, with the point split into its text and its image requests."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import io
import json

import pytest
from PIL import Image

from conveyor import cli
from conveyor.bench.client import payload
from conveyor.bench.dataset import BenchRequest, DatasetConfig, make_dataset
from conveyor.bench.images import parse_size, plan_images

PREFIX = "data:image/jpeg;base64,"


def decode(url: str) -> Image.Image:
    assert url.startswith(PREFIX)
    raw = base64.b64decode(url[len(PREFIX) :], validate=True)  # strict: no stray characters
    image = Image.open(io.BytesIO(raw))
    image.load()
    return image


def test_the_plan_honours_both_fractions_exactly():
    for n, fraction, repeat in ((100, 0.5, 0.0), (101, 0.3, 0.5), (40, 1.0, 0.25), (40, 0.0, 0.5), (7, 1.0, 1.0)):
        plan = plan_images(n, fraction, repeat, seed=3)
        carriers = [j for j in plan if j is not None]
        assert len(plan) == n and len(carriers) == round(fraction * n)
        repeats = len(carriers) - len(set(carriers))
        assert repeats == min(round(repeat * len(carriers)), max(len(carriers) - 1, 0))
        # Sets are numbered as requests draw them: a fresh set is the next number, a repeat an earlier one.
        drawn = 0
        for j in carriers:
            assert j <= drawn
            drawn += j == drawn
    assert plan_images(50, 0.5, 0.2, seed=1) == plan_images(50, 0.5, 0.2, seed=1) != plan_images(50, 0.5, 0.2, seed=2)
    with pytest.raises(ValueError, match="fractions"):
        plan_images(10, 1.5, 0.0, seed=0)


def test_image_requests_are_deterministic_valid_and_distinct(tiny_counter):
    config = DatasetConfig("random", 20, input_len=30, output_len=4, seed=7, image_fraction=0.5, image_size=(96, 64))
    requests = asyncio.run(make_dataset(config, tiny_counter))
    plain = asyncio.run(make_dataset(dataclasses.replace(config, image_fraction=0.0), tiny_counter))
    assert [r.prompt for r in requests] == [r.prompt for r in plain]  # the text is the one drawn without images
    assert [r.prompt_len for r in requests] == [r.prompt_len for r in plain]
    carriers = [r for r in requests if r.images]
    assert len(carriers) == 10 and all(len(r.images) == 1 for r in carriers)
    assert len({r.images for r in carriers}) == 10  # no repeat asked: every picture differs
    for r in carriers:
        image = decode(r.images[0])
        assert image.format == "JPEG" and image.size == (96, 64) and image.mode == "RGB"
    assert asyncio.run(make_dataset(config, tiny_counter)) == requests
    other = asyncio.run(make_dataset(dataclasses.replace(config, seed=8), tiny_counter))
    assert not {url for r in other for url in r.images} & {url for r in carriers for url in r.images}


def test_repeats_resend_earlier_pictures_byte_for_byte(tiny_counter):
    config = DatasetConfig(
        "random", 30, input_len=10, output_len=2, seed=1, image_fraction=1.0, images_per_request=2, image_size=(32, 32)
    )
    repeated = asyncio.run(make_dataset(dataclasses.replace(config, image_repeat_fraction=0.5), tiny_counter))
    assert all(len(r.images) == 2 and r.images[0] != r.images[1] for r in repeated)
    seen: set[tuple[str, ...]] = set()
    num_repeats = 0
    for r in repeated:
        num_repeats += r.images in seen  # a repeat carries pictures an earlier request sent
        seen.add(r.images)
    assert num_repeats == 15 and len(seen) == 15


def test_payload_puts_the_pictures_before_the_text_and_only_in_a_chat():
    request = BenchRequest("what is this?", 5, 3, system_prompt="be brief", images=("data:image/jpeg;base64,AAAA",))
    body = payload(request, "m", chat=True, ignore_eos=True, return_token_ids=False)
    assert body["messages"] == [
        {"role": "system", "content": "be brief"},
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64,AAAA"}},
                {"type": "text", "text": "what is this?"},
            ],
        },
    ]
    with pytest.raises(ValueError, match="chat endpoint"):
        payload(request, "m", chat=False, ignore_eos=True, return_token_ids=False)


def test_serve_sends_images_and_splits_the_point(server, tmp_path, capsys):
    out = tmp_path / "images.json"
    rc = cli.main(
        (
            f"bench serve --base-url {server.url} --dataset random --input-len 12 --output-len 3 --num-prompts 10 "
            f"--image-fraction 0.4 --image-size 48x40 --disable-tqdm --result-json {out}"
        ).split()
    )
    assert rc == 0
    bodies = server.bodies[1:]  # after the test request, which is text
    assert len(bodies) == 10 and all(len(b["messages"]) == 1 for b in bodies)  # the chat endpoint, by default
    contents = [b["messages"][0]["content"] for b in bodies]
    with_images = [c for c in contents if isinstance(c, list)]
    assert len(with_images) == 4
    for content in with_images:
        assert [part["type"] for part in content] == ["image_url", "text"]
        assert decode(content[0]["image_url"]["url"]).size == (48, 40)
    points = json.loads(out.read_text())["points"]
    assert [p["label"] for p in points] == ["rate inf", "rate inf: text", "rate inf: images"]
    assert [p["num_completed"] for p in points] == [10, 6, 4]
    assert points[1]["request_throughput"] + points[2]["request_throughput"] == pytest.approx(points[0]["request_throughput"])
    assert all(p["duration_s"] == points[0]["duration_s"] for p in points)
    stdout = capsys.readouterr().out
    assert "4 of 10 requests carry 1 image(s) of 48x40" in stdout and "| rate inf: images |" in stdout


def test_images_refuse_the_completion_endpoint_and_bad_flags(server, capsys):
    args = f"bench serve --base-url {server.url} --num-prompts 2 --input-len 4 --output-len 1 --disable-tqdm".split()
    assert cli.main([*args, "--image-fraction", "1", "--endpoint", "/v1/completions"]) == 1
    assert "need the chat endpoint" in capsys.readouterr().err and server.bodies == []
    for flags in (["--image-fraction", "1.5"], ["--image-size", "640"], ["--image-size", "0x10"], ["--images-per-request", "0"]):
        with pytest.raises(SystemExit):
            cli.main([*args, *flags])
    err = capsys.readouterr().err
    assert "fraction in [0, 1]" in err and "WIDTHxHEIGHT" in err and "at least 1" in err
    assert parse_size("640X480") == (640, 480)
    with pytest.raises(ValueError):
        parse_size("axb")
