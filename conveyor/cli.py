"""The `conveyor` command: `conveyor serve` starts the daemon (every stage, supervised);
`conveyor bench serve | offline | step | forward` runs the benchmarks (conveyor/bench).

Bad options and bad checkpoints get one line on stderr and a non-zero exit, never a traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys

from conveyor.config import ConfigError
from conveyor.config.build import SERVER_OPTIONS, server_option_default
from conveyor.config.env import api_key_from_env, log_level


def serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve a checkpoint over the OpenAI-compatible HTTP API")
    p.add_argument("--model", help="local Hugging Face checkpoint directory (default: the embedded tiny Llama)")
    p.add_argument("--served-model-name", help="model name in the API (default: the directory name)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--max-model-len", type=int, help="context length (default: the model's)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--num-kv-blocks", type=int, help="fix the KV pool size (default: from free memory)")
    p.add_argument("--kv-cache-gib", type=float, help="CPU: memory for the KV pool in GiB (default 1)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.90)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget per forward pass")
    p.add_argument("--max-num-seqs", type=int, default=256, help="sequences running at once")
    p.add_argument("--scheduling-policy", default="splitfuse", choices=["splitfuse", "prefill_first", "orca"])
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                   help="plan the next step while the current one computes")  # fmt: skip
    p.add_argument("--max-queued-requests", type=int,
                   help="waiting requests past which new ones get 429 (default 1024; 0: no bound)")  # fmt: skip
    p.add_argument("--max-queued-tokens", type=int,
                   help="waiting prompt tokens past which new ones get 429 (default 1048576; 0: no bound)")  # fmt: skip
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--api-key", help="require this key (Authorization: Bearer or X-Api-Key); visible in ps: "
                   "prefer CONVEYOR_API_KEY or --api-key-file")  # fmt: skip
    p.add_argument("--api-key-file", help="read the API key from this file (its first line)")
    p.add_argument("--chat-content-special-tokens", action="store_true",
                   help="encode special tokens written inside chat message content as special tokens "
                   "(off: they are plain text, so users cannot forge roles)")  # fmt: skip
    for field, flag, type_, text in SERVER_OPTIONS:
        p.add_argument(f"--{flag}", dest=field, type=type_, help=f"{text} (default {server_option_default(field)})")
    p.add_argument("--allowed-origins", nargs="*", default=[], help="CORS origins allowed ('*' for any)")
    p.add_argument("--chat-template", help="Jinja file (or text) overriding the checkpoint's chat template")
    p.add_argument("--ingress-workers", type=int, default=1, help="HTTP processes sharing the port")
    p.add_argument("--tokenizer-workers", type=int, default=1)
    p.add_argument("--detokenizer-workers", type=int, default=1)


def bench_parser(sub: argparse._SubParsersAction) -> None:
    from conveyor.bench import args as bench_args  # flags only: nothing heavy imports here

    p = sub.add_parser("bench", help="benchmarks: an HTTP load generator, offline throughput, scheduler step cost")
    which = p.add_subparsers(dest="bench", required=True)
    bench_args.add_serve(which.add_parser(
        "serve", help="load an OpenAI-compatible server over HTTP: latency, throughput, effective throughput"
    ))  # fmt: skip
    bench_args.add_offline(which.add_parser(
        "offline", help="offline tokens/s of conveyor's LLM API against transformers' generate"
    ))  # fmt: skip
    bench_args.add_step(which.add_parser("step", help="CPU cost of one scheduler step over N running decodes"))
    bench_args.add_forward(which.add_parser(
        "forward", help="one worker step on the CPU, with and without the C++ kernels, interleaved"
    ))  # fmt: skip


def bench(args: argparse.Namespace) -> int:
    if args.bench == "serve":
        from conveyor.bench import serve

        return serve.main(args)
    if args.bench == "offline":
        from conveyor.bench import offline

        return offline.main(args)
    if args.bench == "forward":
        from conveyor.bench import forward

        return forward.main(args)
    from conveyor.bench import step

    return step.main(args.running, prepare=args.prepare, device=args.device)


def serve(args: argparse.Namespace) -> int:
    from conveyor.config.build import build_engine_config
    from conveyor.stages.launcher import Launcher

    config = build_engine_config(
        args.model,
        dtype=args.dtype,
        device=args.device,
        max_model_len=args.max_model_len,
        served_model_name=args.served_model_name,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_gib=args.kv_cache_gib,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        scheduling_policy=args.scheduling_policy,
        enable_prefix_caching=args.enable_prefix_caching,
        async_scheduling=args.async_scheduling,
        max_queued_requests=args.max_queued_requests,
        max_queued_tokens=args.max_queued_tokens,
        tensor_parallel_size=args.tensor_parallel_size,
        ingress_workers=args.ingress_workers,
        tokenizer_workers=args.tokenizer_workers,
        detokenizer_workers=args.detokenizer_workers,
        host=args.host,
        port=args.port,
        api_key=resolve_api_key(args),
        allowed_origins=tuple(args.allowed_origins),
        chat_template=args.chat_template,
        server_options={
            "special_tokens_in_content": args.chat_content_special_tokens,
            **{field: getattr(args, field) for field, *_ in SERVER_OPTIONS},
        },
    )
    return Launcher(config).serve()


def resolve_api_key(args: argparse.Namespace) -> str | None:
    """--api-key, else --api-key-file, else CONVEYOR_API_KEY; the key is kept in memory only."""
    if args.api_key is not None:
        return args.api_key
    if args.api_key_file is not None:
        try:
            with open(args.api_key_file, encoding="utf-8") as f:
                key = f.readline().strip()
        except OSError as e:
            raise ConfigError(f"cannot read the API key file {args.api_key_file!r}: {e.strerror}") from None
        if not key:
            raise ConfigError(f"the API key file {args.api_key_file!r} is empty")
        return key
    return api_key_from_env()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="conveyor", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    serve_parser(sub)
    bench_parser(sub)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=log_level().upper(), format="%(asctime)s %(levelname)s [launcher] %(message)s", datefmt="%H:%M:%S"
    )
    try:
        return serve(args) if args.command == "serve" else bench(args)
    except ConfigError as e:
        print(f"conveyor: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
