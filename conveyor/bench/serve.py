"""`conveyor bench serve`: load an OpenAI-compatible server (conveyor, vLLM, SGLang, ...) over
HTTP and measure what its clients see.

    conveyor bench serve --base-url http://127.0.0.1:8000 --dataset sharegpt \\
        --dataset-path sharegpt.json --request-rate 8 --num-prompts 500
    conveyor bench serve --dataset fastgen-2600-60 --sweep-clients 1,2,4,8,16,32 \\
        --result-json out.json --plot-dir plots/
    conveyor bench serve --dataset multi-turn --dataset-path sharegpt.json --multi-turn-active 60 --multi-turn-concurrency 8
    conveyor bench serve --dataset random --input-len 64 --output-len 16 --image-fraction 0.5 --image-size 640x480

`run` is one run: one load point (open loop, load.py) or one per client count (closed loop), every
request streamed on one event loop and measured by results.py; the table goes to stdout, the
figures and the JSON where asked. Invariants: a server that cannot answer one short test request
stops the run before any point; each point draws its own prompts (and, with --num-system-prompts,
its own shared system prompts: system_prompts.py), so no point finds another's in a prefix cache;
a point's prefix cache hit rate comes from the servers' /metrics around it (server_metrics.py).
The multi-turn dataset is one point of its own: conversations replayed turn by turn, many
interleaved by a few clients (multi_turn.py), on the chat endpoint unless --endpoint says otherwise.
With --image-fraction, that share of the requests carries generated pictures (images.py), on the
chat endpoint; each point is then followed by its text and its image requests apart (labels
"...: text", "...: images"), over the same duration, so their req/s add up to the point's.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import sys

import aiohttp
from tqdm import tqdm

from conveyor.bench import client, images, load, multi_turn, server_metrics
from conveyor.bench.dataset import MULTI_TURN, BenchRequest, DatasetConfig, make_dataset
from conveyor.bench.multi_turn import MultiTurnConfig
from conveyor.bench.prompts import TokenCounter, choose_counter
from conveyor.bench.results import ServeMetrics, compute, table

DEFAULT_PROMPTS, DEFAULT_PROMPTS_PER_POINT = 500, 512  # vLLM's ShareGPT runs; FastGen's sweeps
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


@dataclasses.dataclass(frozen=True)
class ServeBenchConfig:
    base_url: str = "http://127.0.0.1:8000"
    endpoint: str = COMPLETIONS
    model: str | None = None  # None: the first of GET /v1/models
    api_key: str | None = None
    tokenizer: str | None = None  # tokenizer.json, for servers without POST /tokenize
    dataset: DatasetConfig = DatasetConfig()
    ignore_eos: bool | None = None  # None: on for synthetic datasets
    return_token_ids: bool = True
    request_rate: float = math.inf
    max_concurrency: int | None = None
    sweep_clients: tuple[int, ...] = ()  # closed loop, one point per count
    request_timeout: float = 1800.0
    progress: bool = True
    extra_body: dict | None = None  # merged into every request body (a constraint, say)
    metrics_urls: tuple[str, ...] = ()  # whose /metrics tell the prefix cache hit rate (): base_url
    multi_turn: MultiTurnConfig = MultiTurnConfig()  # the multi-turn dataset's load

    @property
    def metrics_sources(self) -> tuple[str, ...]:
        return self.metrics_urls or (self.base_url,)

    @property
    def chat(self) -> bool:
        return self.endpoint.rstrip("/").endswith("chat/completions")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServeBenchConfig:
        sweep = tuple(args.sweep_clients or ())
        num = args.num_prompts or (DEFAULT_PROMPTS_PER_POINT if sweep else DEFAULT_PROMPTS)
        return cls(
            base_url=args.base_url.rstrip("/"),
            endpoint=args.endpoint or (CHAT if args.dataset == MULTI_TURN or args.image_fraction else COMPLETIONS),
            model=args.model,
            api_key=args.api_key,
            tokenizer=args.tokenizer,
            dataset=_dataset(args, num),
            ignore_eos=args.ignore_eos,
            return_token_ids=args.return_token_ids,
            request_rate=args.request_rate,
            max_concurrency=args.max_concurrency,
            sweep_clients=sweep,
            request_timeout=args.request_timeout,
            progress=not args.disable_tqdm,
            extra_body=args.extra_body,
            metrics_urls=args.metrics_url or (),
            multi_turn=MultiTurnConfig(
                concurrency=args.multi_turn_concurrency,
                active=args.multi_turn_active,
                think_time=args.multi_turn_think_time,
                max_output=args.multi_turn_max_output,
                max_context=args.multi_turn_max_context,
                replies=args.multi_turn_replies,
                context_len=args.multi_turn_context_len,
            ),
        )


@dataclasses.dataclass
class ServeReport:
    model: str
    counter: str  # how prompt lengths were counted
    points: list[ServeMetrics]

    def as_dict(self, config: ServeBenchConfig) -> dict:
        settings = dataclasses.asdict(config)
        settings["request_rate"] = None if math.isinf(config.request_rate) else config.request_rate
        settings["api_key"] = "(set)" if config.api_key else None  # never written to a file
        return {"config": settings, "model": self.model, "counter": self.counter, "points": [m.as_dict() for m in self.points]}


class BenchError(Exception):
    """The run cannot start: no model listed, or the test request failed."""


async def run(config: ServeBenchConfig) -> ServeReport:
    if config.dataset.image_fraction and not config.chat:
        raise BenchError("requests with images need the chat endpoint: --endpoint /v1/chat/completions")
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    timeout = aiohttp.ClientTimeout(total=config.request_timeout)
    connector = aiohttp.TCPConnector(limit=0)  # as many connections as requests in flight
    async with aiohttp.ClientSession(headers=headers, timeout=timeout, connector=connector) as session:
        model = config.model or await first_model(session, config.base_url)
        counter = await choose_counter(session, config.base_url, model, config.tokenizer)
        ignore_eos = config.dataset.synthetic if config.ignore_eos is None else config.ignore_eos
        url = config.base_url + config.endpoint

        async def send(request: BenchRequest) -> client.RequestResult:
            body = client.payload(request, model, chat=config.chat, ignore_eos=ignore_eos, return_token_ids=config.return_token_ids)
            body.update(config.extra_body or {})
            return await client.send(session, url, request, body)

        if config.dataset.name == MULTI_TURN:
            point = await _multi_turn_point(config, session, model, counter, ignore_eos, send)
            return ServeReport(model, counter.name, [point])
        points = []
        for i, (label, clients) in enumerate(_points(config)):
            # Drawn afresh per point (seed + i), so that no point finds another's prompts cached.
            requests = await make_dataset(dataclasses.replace(config.dataset, seed=config.dataset.seed + i), counter)
            if not requests:
                raise BenchError("the dataset is empty (a ShareGPT file with no usable conversation?)")
            if i == 0:
                print(_header(config, model, counter, requests), flush=True)
                await _test_request(send)
            before = await server_metrics.scrape_all(session, config.metrics_sources)
            with tqdm(total=len(requests), desc=label, disable=not config.progress, unit="req") as bar:
                if clients is None:
                    results, duration = await load.open_loop(
                        requests,
                        send,
                        rate=config.request_rate,
                        max_concurrency=config.max_concurrency,
                        seed=config.dataset.seed,
                        progress=bar,
                    )
                else:
                    results, duration = await load.closed_loop(requests, send, num_clients=clients, progress=bar)
            after = await server_metrics.scrape_all(session, config.metrics_sources)
            rate = None if clients is not None or math.isinf(config.request_rate) else config.request_rate
            points.append(
                compute(
                    results,
                    duration,
                    label=label,
                    num_clients=clients,
                    request_rate=rate,
                    prefix_cache_hit_rate=server_metrics.hit_rate(before, after),
                    kv_host_hit_rate=server_metrics.host_hit_rate(before, after),
                )
            )
            if config.dataset.image_fraction:
                points += _by_images(results, duration, label=label, num_clients=clients, request_rate=rate)
        return ServeReport(model, counter.name, points)


def _by_images(results: list[client.RequestResult], duration: float, **point) -> list[ServeMetrics]:
    """The point's text requests and its image requests apart, each over the whole run's duration
    (so the two req/s add up to the point's); a kind the point did not send has no column."""
    label = point.pop("label")
    kinds = (("text", [r for r in results if not r.num_images]), ("images", [r for r in results if r.num_images]))
    return [compute(part, duration, label=f"{label}: {kind}", **point) for kind, part in kinds if part]


async def _multi_turn_point(
    config: ServeBenchConfig, session: aiohttp.ClientSession, model: str, counter: TokenCounter, ignore_eos: bool, send: load.Send
) -> ServeMetrics:
    """The multi-turn dataset's one point (multi_turn.py): its header, the test request, its turns."""
    dataset = config.dataset
    if config.sweep_clients or config.max_concurrency or not math.isinf(config.request_rate) or dataset.num_system_prompts:
        raise BenchError(
            "multi-turn sets its load with --multi-turn-active and --multi-turn-concurrency: "
            "it takes no --sweep-clients, --request-rate, --max-concurrency or --num-system-prompts"
        )
    if dataset.image_fraction:
        raise BenchError("multi-turn replays ShareGPT's text: it takes no --image-fraction")
    turns = config.multi_turn
    conversations = await multi_turn.make_conversations(config.dataset, turns, counter)
    if not conversations:
        raise BenchError("no conversation has two turns within --multi-turn-max-context")
    pool = await server_metrics.kv_pool_tokens(session, config.metrics_sources)
    print(f"{config.base_url}{config.endpoint}, model {model}, prompt tokens counted by {counter.name}", flush=True)
    print(multi_turn.describe(conversations, turns, pool), flush=True)
    await _test_request(send)
    url = config.base_url + config.endpoint

    async def send_turn(turn: multi_turn.Turn) -> client.RequestResult:
        body = multi_turn.payload(turn, model, chat=config.chat, ignore_eos=ignore_eos, return_token_ids=config.return_token_ids)
        body.update(config.extra_body or {})
        return await client.send(session, url, turn.request(), body)

    num_clients = min(turns.concurrency, turns.num_active, len(conversations))
    label = f"{min(turns.num_active, len(conversations))} conversations, {num_clients} clients"
    before = await server_metrics.scrape_all(session, config.metrics_sources)
    with tqdm(total=sum(len(c) for c in conversations), desc=label, disable=not config.progress, unit="req") as bar:
        results, duration = await multi_turn.replay(
            conversations,
            send_turn,
            concurrency=turns.concurrency,
            active=turns.active,
            think_time=turns.think_time,
            progress=bar,
            replies=turns.replies,
        )
    after = await server_metrics.scrape_all(session, config.metrics_sources)
    return compute(
        results,
        duration,
        label=label,
        num_clients=num_clients,
        prefix_cache_hit_rate=server_metrics.hit_rate(before, after),
        kv_host_hit_rate=server_metrics.host_hit_rate(before, after),
    )


async def first_model(session: aiohttp.ClientSession, base_url: str) -> str:
    try:
        async with session.get(base_url + "/v1/models") as resp:
            listed = (await resp.json(content_type=None)).get("data") or []
    except (aiohttp.ClientError, ValueError, AttributeError) as e:
        raise BenchError(f"cannot list the models at {base_url}/v1/models: {e}") from None
    if not listed:
        raise BenchError(f"{base_url}/v1/models lists no model; name one with --model")
    return listed[0]["id"]


async def _test_request(send) -> None:
    """One short request the dataset does not hold (it would find its prompt cached)."""
    result = await send(BenchRequest("This is a test request of conveyor bench.", 0, 4))
    if not result.success:
        raise BenchError(f"the test request failed: {result.error}")


def _points(config: ServeBenchConfig) -> list[tuple[str, int | None]]:
    if config.sweep_clients:
        return [(f"{n} client{'s' if n > 1 else ''}", n) for n in config.sweep_clients]
    rate = "inf" if math.isinf(config.request_rate) else f"{config.request_rate:g}"
    limit = f", max {config.max_concurrency}" if config.max_concurrency else ""
    return [(f"rate {rate}{limit}", None)]


def _header(config: ServeBenchConfig, model: str, counter: TokenCounter, requests: list[BenchRequest]) -> str:
    prompt = sum(r.prompt_len for r in requests) / len(requests)
    output = sum(r.output_len for r in requests) / len(requests)
    any_images = any(r.images for r in requests)
    return (
        f"{config.base_url}{config.endpoint}, model {model}\n"
        f"dataset {config.dataset.name}: {len(requests)} requests per point, mean prompt {prompt:.0f} / "
        f"max output {output:.0f} tokens (prompt tokens counted by {counter.name}{', text only' if any_images else ''})"
        + _shared_line(config.dataset)
        + (images.describe(requests, config.dataset) if any_images else "")
    )


def _shared_line(dataset: DatasetConfig) -> str:
    if not dataset.num_system_prompts:
        return ""
    return f"\neach opens with one of {dataset.num_system_prompts} shared system prompts of ~{dataset.system_prompt_len} tokens"


def _dataset(args: argparse.Namespace, num_prompts: int) -> DatasetConfig:
    return DatasetConfig(
        name=args.dataset,
        num_prompts=num_prompts,
        path=args.dataset_path,
        input_len=args.input_len,
        output_len=args.output_len,
        range_ratio=args.random_range_ratio,
        seed=args.seed,
        num_system_prompts=args.num_system_prompts,
        system_prompt_len=args.system_prompt_len,
        image_fraction=args.image_fraction,
        images_per_request=args.images_per_request,
        image_size=args.image_size,
        image_repeat_fraction=args.image_repeat_fraction,
    )


def main(args: argparse.Namespace) -> int:
    config = ServeBenchConfig.from_args(args)
    try:
        report = asyncio.run(run(config))
    except (BenchError, ValueError, aiohttp.ClientError) as e:
        print(f"conveyor bench serve: error: {e}", file=sys.stderr)
        return 1
    print(table(report.points))
    for m in report.points:
        for error, count in m.errors.items():
            print(f"{m.label}: {count} failed: {error}")
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump(report.as_dict(config), f, indent=2)
    if args.plot_dir:
        from conveyor.bench.plots import write_plots

        write_plots(report.points, args.plot_dir, title=f"{report.model}, {config.dataset.name}")
    return 0
