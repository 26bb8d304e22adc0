"""TTFT of one-image chat requests against a running daemon, beside text-only ones (issue 51).

    python -m conveyor serve --model DIR --device cpu --port 8095 &   # DIR: a vision checkpoint
    python ops/bench/image_ttft.py --base-url http://127.0.0.1:8095 --requests 20

Sends --requests streaming chat requests one at a time, alternating: one --width x --height JPEG
(a data: URL, as a client sends it) plus a line of text, then text alone of about as many prompt
tokens as the image request had (its placeholders included), so the two differ in the image's
path (ingress decode of base64, tokenizer-stage preprocessing, the tower) and not in prompt
length. Prints the median time to the first streamed token of each, and the ratio.

--stages also reads the daemon's /metrics after each request and splits each kind's TTFT by the
stage hops the request passed before its first token (`conveyor_stage_latency_seconds`: ingress,
tokenizer, scheduler_queue, worker; means per request), the rest being the sockets between them,
the detokenizer and HTTP.
"""

from __future__ import annotations

import argparse
import base64
import collections
import io
import re
import statistics
import time
import urllib.request

import numpy as np
import openai
from PIL import Image


def jpeg_url(width: int, height: int, seed: int) -> str:
    rng = np.random.default_rng(seed)
    out = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(out, format="JPEG", quality=90)
    return "data:image/jpeg;base64," + base64.b64encode(out.getvalue()).decode()


def ttft(client: openai.OpenAI, model: str, content: object) -> tuple[float, int]:
    began = time.perf_counter()
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": content}],  # type: ignore[list-item,misc]
        max_tokens=4,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    first, prompt_tokens = None, 0
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content is not None:
            first = time.perf_counter() - began
        if chunk.usage is not None:
            prompt_tokens = chunk.usage.prompt_tokens
    assert first is not None
    return first, prompt_tokens


HOPS = ("ingress", "tokenizer", "scheduler_queue", "worker")  # before the first token, in order


def stage_sums(base_url: str) -> dict[str, float]:
    """Seconds each stage hop has taken over all requests so far (the histogram's _sum)."""
    text = urllib.request.urlopen(f"{base_url}/metrics").read().decode()
    found = re.findall(r'^conveyor_stage_latency_seconds_sum\{stage="(\w+)"\} (\S+)$', text, re.M)
    return {stage: float(value) for stage, value in found}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", required=True)
    p.add_argument("--requests", type=int, default=20)
    p.add_argument("--width", type=int, default=640)
    p.add_argument("--height", type=int, default=480)
    p.add_argument("--stages", action="store_true", help="split each kind's TTFT by stage hop, from /metrics")
    args = p.parse_args()
    client = openai.OpenAI(base_url=f"{args.base_url}/v1", api_key="none")
    model = client.models.list().data[0].id
    question = [{"type": "text", "text": "what is in this picture?"}]
    _, prompt_tokens = ttft(
        client, model, [{"type": "image_url", "image_url": {"url": jpeg_url(args.width, args.height, 0)}}, *question]
    )
    words = " ".join(["river"] * prompt_tokens)
    _, text_tokens = ttft(client, model, words)
    words = " ".join(["river"] * max(1, prompt_tokens - (text_tokens - prompt_tokens)))  # about as long
    image_times, text_times = [], []
    spent: dict[str, collections.Counter[str]] = {"image": collections.Counter(), "text": collections.Counter()}
    before = stage_sums(args.base_url) if args.stages else {}

    def measured(kind: str, times: list[float], content: object) -> None:
        nonlocal before
        times.append(ttft(client, model, content)[0])
        if args.stages:
            time.sleep(0.05)  # the last hops are observed as the stream ends
            after = stage_sums(args.base_url)
            spent[kind].update({hop: after.get(hop, 0.0) - before.get(hop, 0.0) for hop in HOPS})
            before = after

    for i in range(args.requests):
        url = jpeg_url(args.width, args.height, i + 1)  # a new picture each time: no encoder or prefix cache hit
        measured("image", image_times, [{"type": "image_url", "image_url": {"url": url}}, *question])
        measured("text", text_times, f"{i} {words}")
    image, text = statistics.median(image_times), statistics.median(text_times)
    print(f"{args.requests} requests each, {args.width}x{args.height} JPEG, {prompt_tokens} prompt tokens with the image")
    print(f"TTFT median: one image {image * 1000:.1f} ms, text alone {text * 1000:.1f} ms, ratio {image / text:.2f}")
    if args.stages:
        print("means per request (ms) | " + " | ".join(HOPS) + " | rest | TTFT mean")
        for kind, times in (("image", image_times), ("text", text_times)):
            hops = [spent[kind][hop] / len(times) * 1000 for hop in HOPS]
            mean = statistics.fmean(times) * 1000
            print(f"{kind} | " + " | ".join(f"{h:.1f}" for h in hops) + f" | {mean - sum(hops):.1f} | {mean:.1f}")


if __name__ == "__main__":
    main()
