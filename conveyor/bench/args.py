"""The flags of `conveyor bench serve | offline | step | forward | sampling | cpu | roofline`, kept apart from the benchmarks so that
building the parser imports neither aiohttp nor torch."""

from __future__ import annotations

import argparse
import json
import math

from conveyor.config.engine_options import option_settings
from conveyor.config.options import add_arguments

# The engine options `bench offline` passes to LLM(...): flags, defaults and help are the config's.
OFFLINE_ENGINE_OPTIONS = ("device", "dtype", "max_num_seqs", "max_num_batched_tokens", "num_kv_blocks", "gpu_memory_utilization")

DATASET_HELP = (
    "sharegpt (needs --dataset-path), random (--input-len/--output-len), prefill-heavy (~462 in, 16 out), "
    "decode-heavy (~462 in, 256 out), fastgen-PROMPT-OUTPUT (FastGen's normal workloads, e.g. fastgen-1200-60, "
    "fastgen-2600-128: 30%% spread), fixed, normal; bench serve only: multi-turn (ShareGPT conversations "
    "replayed turn by turn, needs --dataset-path; --num-prompts counts conversations)"
)


def add_dataset(p: argparse.ArgumentParser, *, num_prompts: int | None, num_prompts_help: str) -> None:
    d = p.add_argument_group("workload")
    d.add_argument("--dataset", default="random", help=DATASET_HELP)
    d.add_argument("--dataset-path", help="ShareGPT JSON (list of {conversations: [{from, value}, ...]})")
    d.add_argument("--num-prompts", type=int, default=num_prompts, help=num_prompts_help)
    d.add_argument("--input-len", type=int, default=1024, help="prompt tokens (random, fixed, normal)")
    d.add_argument("--output-len", type=int, default=128, help="output tokens (random, fixed, normal)")
    d.add_argument(
        "--random-range-ratio", type=float, default=1.0, help="random: lengths uniform in [ratio * len, len] (1.0: exactly len)"
    )
    d.add_argument("--seed", type=int, default=0)


def add_serve(p: argparse.ArgumentParser) -> None:
    s = p.add_argument_group("server")
    s.add_argument("--base-url", default="http://127.0.0.1:8000")
    s.add_argument(
        "--endpoint", help="/v1/completions or /v1/chat/completions (default: the chat one for multi-turn, else completions)"
    )
    s.add_argument("--model", help="model name in the API (default: the first of GET /v1/models)")
    s.add_argument("--api-key", help="sent as Authorization: Bearer")
    s.add_argument(
        "--tokenizer",
        help="count prompt lengths here with this tokenizer.json (or a checkpoint directory's) "
        "(default: the server's POST /tokenize, else 4/3 tokens per word)",
    )
    s.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="ask for exactly max_tokens (default: on for synthetic datasets, off for sharegpt)",
    )
    s.add_argument(
        "--return-token-ids",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="ask for each chunk's token ids, to count tokens per chunk exactly",
    )
    s.add_argument("--request-timeout", type=float, default=1800.0, help="seconds per request")
    s.add_argument(
        "--metrics-url",
        type=_url_list,
        default=None,
        metavar="URL[,URL...]",
        help="servers whose /metrics give the prefix cache hit rate, e.g. the replicas behind a router (default: --base-url)",
    )
    s.add_argument(
        "--extra-body", type=_json_object, default=None, help="JSON object merged into every request body, e.g. a response_format"
    )
    add_dataset(p, num_prompts=None, num_prompts_help="requests per run (default 500) or per sweep point (default 512)")
    shared = p.add_argument_group("shared system prompts (any dataset)")
    shared.add_argument(
        "--num-system-prompts",
        type=_count(0),
        default=0,
        help="K: open every request with one of K shared system prompts, picked by --seed (0: none)",
    )
    shared.add_argument(
        "--system-prompt-len",
        type=_count(1),
        default=256,
        help="tokens of each system prompt (random words; the prompt length counts them too)",
    )
    pictures = p.add_argument_group("images (any dataset but multi-turn; the chat endpoint)")
    pictures.add_argument(
        "--image-fraction",
        type=_fraction,
        default=0.0,
        help="share of the requests that carry generated JPEGs as data: URLs, picked by --seed (0: none)",
    )
    pictures.add_argument("--images-per-request", type=_count(1), default=1, help="pictures in each request that has any")
    pictures.add_argument(
        "--image-size", type=_size, default=(640, 480), metavar="WxH", help="each picture's pixels (default 640x480)"
    )
    pictures.add_argument(
        "--image-repeat-fraction",
        type=_fraction,
        default=0.0,
        help="share of the image requests that resend an earlier one's pictures, to hit an encoder or prefix cache (default 0)",
    )
    turns = p.add_argument_group("multi-turn (--dataset multi-turn)")
    turns.add_argument(
        "--multi-turn-concurrency",
        type=_count(1),
        default=16,
        help="clients: turns in flight at most, each the next turn of the active conversation that has waited longest",
    )
    turns.add_argument(
        "--multi-turn-active",
        type=_count(1),
        help="conversations interleaved, the KV working set: about this x the mean prompt (the run's header says how "
        "that compares with the server's KV pool); default: --multi-turn-concurrency, each client a closed loop",
    )
    turns.add_argument(
        "--multi-turn-think-time",
        type=_seconds,
        default=0.0,
        help="seconds from a turn's end until its conversation's next turn may go (default 0)",
    )
    turns.add_argument(
        "--multi-turn-replies",
        choices=("generated", "recorded"),
        default="generated",
        help="the assistant's turns: the server's own replies, as a chat client sends them back, or ShareGPT's recorded ones",
    )
    turns.add_argument(
        "--multi-turn-max-output", type=_count(1), default=256, help="cap on a turn's max_tokens (the recorded reply's length)"
    )
    turns.add_argument(
        "--multi-turn-context-len",
        type=_count(0),
        default=0,
        help="tokens of a system message of its own that opens each conversation (random words: an agent's or RAG "
        "chat's document, repeated every turn; 0: none)",
    )
    turns.add_argument(
        "--multi-turn-max-context",
        type=_count(2),
        default=2000,
        help="a conversation ends before a turn's prompt + output exceeds this many tokens "
        "(the prompt is estimated: keep a margin under the model's context length)",
    )
    load = p.add_argument_group("load")
    load.add_argument(
        "--request-rate", type=float, default=math.inf, help="Poisson arrivals per second (default inf: every request at once)"
    )
    load.add_argument("--max-concurrency", type=int, help="requests in flight at most (open loop)")
    load.add_argument("--sweep-clients", type=_int_list, help="closed loop, one run per count: e.g. 1,2,4,8,16,32 (FastGen's clients)")
    out = p.add_argument_group("output")
    out.add_argument("--result-json", help="write every metric of every point here")
    out.add_argument("--plot-dir", help="write throughput_latency.png, effective_throughput.png, token_latency.png")
    out.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def add_offline(p: argparse.ArgumentParser) -> None:
    e = p.add_argument_group("engine")
    add_arguments(e, option_settings("model", *OFFLINE_ENGINE_OPTIONS))
    e.add_argument("--hf-batch-size", type=int, default=16, help="transformers baseline: prompts per static batch")
    e.add_argument("--skip-hf", action="store_true", help="conveyor only")
    add_dataset(p, num_prompts=200, num_prompts_help="requests (default 200)")
    p.add_argument("--result-json", help="write both results here")


def add_step(p: argparse.ArgumentParser) -> None:
    p.add_argument("--running", type=int, nargs="+", default=[1, 16, 64, 256, 1024])
    p.add_argument(
        "--prepare", action="store_true", help="also time one ModelRunner input preparation alone (loads torch and the tiny model)"
    )
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="for --prepare")
    p.add_argument("--worker", action="store_true", help="the worker's host work per decode step instead, on an emulated H100")


def add_forward(p: argparse.ArgumentParser) -> None:
    from conveyor.bench.forward import parse_shape

    p.add_argument(
        "--decode",
        type=parse_shape,
        nargs="*",
        default=[(256, 500), (32, 200), (1, 200)],
        metavar="ROWSxCONTEXT",
        help="decode steps: ROWS sequences with CONTEXT tokens each",
    )
    p.add_argument(
        "--prefill",
        type=parse_shape,
        nargs="*",
        default=[(10, 200), (8, 256)],
        metavar="ROWSxLEN",
        help="prefill steps: ROWS fresh prompts of LEN tokens (8x256 fills the default budget)",
    )
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds over the variants")
    p.add_argument("--repeats", type=int, default=5, help="steps per variant and shape in a round")


def add_roofline(p: argparse.ArgumentParser) -> None:
    add_arguments(p, option_settings("model", "quantization"))
    p.add_argument(
        "--isa",
        type=_isa_variants,
        metavar="VARIANT[,VARIANT...]",
        help="the C++ kernels' ISA variants, each in its own process, or all this CPU runs (default: CONVEYOR_CPU_ISA's)",
    )
    p.add_argument("--rows", type=_count(1), default=1, help="sequences decoding together (1: one stream)")
    p.add_argument(
        "--threads",
        type=_count(1),
        help="torch's (and the C++ kernels') threads for the steps (default: as the cpu backend finds them)",
    )
    p.add_argument("--context", type=_count(1), default=128, help="prompt tokens of each row before the timed steps")
    p.add_argument("--steps", type=_count(1), default=30, help="decode steps per round, timed with and again without the op timers")
    p.add_argument("--warmup", type=_count(0), default=5, help="untimed decode steps per round")
    p.add_argument("--rounds", type=_count(1), default=5, help="interleaved rounds over the variants")
    p.add_argument("--repeats", type=_count(1), default=10, help="timed passes of each bandwidth kernel per round")
    p.add_argument("--array-mib", type=_count(1), help="MiB of each bandwidth array (default: 4x the L3, else 256)")
    p.add_argument(
        "--temperature",
        type=_non_negative,
        default=0.0,
        help="0: greedy draws (the argmax head); above: logits and the sampler's draw",
    )
    p.add_argument("--json", help="also write the figures here")


def add_sampling(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rows", type=int, nargs="+", default=[1, 32, 256], help="logits rows S (one draw each)")
    p.add_argument("--vocab", type=int, nargs="+", default=[32000, 128256], help="vocabulary sizes V")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds over the variants")
    p.add_argument("--repeats", type=int, default=5, help="calls per variant and shape in a round")


def add_cpu(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the daemon whose /metrics count the tokens")
    p.add_argument("--json", help="also write the figures here")
    p.add_argument("client", nargs=argparse.REMAINDER, help="-- then the client command line")


def _isa_variants(text: str) -> tuple[str, ...]:
    from conveyor.bench.roofline import parse_isa  # reads the CPU's features: only when --isa is given

    return parse_isa(text)


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("client counts must be positive")
    return values


def _url_list(text: str) -> tuple[str, ...]:
    urls = tuple(u.strip().rstrip("/") for u in text.split(",") if u.strip())
    if not urls:
        raise argparse.ArgumentTypeError("expected comma-separated base URLs")
    return urls


def _count(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}")
        return value

    return parse


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not value >= 0 or math.isinf(value):
        raise argparse.ArgumentTypeError("must be a finite number of seconds, at least 0")
    return value


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a fraction, got {text!r}") from None
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError("must be a fraction in [0, 1]")
    return value


def _size(text: str) -> tuple[int, int]:
    from conveyor.bench.images import parse_size  # numpy only: the parser still imports no aiohttp or torch

    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _non_negative(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError("must be finite and at least 0")
    return value


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value
