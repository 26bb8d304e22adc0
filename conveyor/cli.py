"""The `conveyor` command: `conveyor serve` starts the daemon (every stage, supervised);
`conveyor router --backends URL,...` routes one endpoint's requests to several daemons
(stages/replica_router); `conveyor bench serve | offline | step | forward | sampling | cpu | roofline` runs the
benchmarks (conveyor/bench).

Bad options and bad checkpoints get one line on stderr and a non-zero exit, never a traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys

from conveyor.config import ConfigError, ServerConfig
from conveyor.config.engine_options import OPTION_CLASSES
from conveyor.config.env import api_key_from_env, log_level
from conveyor.config.options import DefaultsHelpFormatter, add_arguments, settings
from conveyor.engine_config import build_engine_config


def serve_parser(sub: argparse._SubParsersAction) -> None:
    """One flag per option() field of the config classes (config/options.py), grouped by class;
    --api-key-file is the only flag that is not a setting."""
    p = sub.add_parser("serve", help="serve a checkpoint over the OpenAI-compatible HTTP API", formatter_class=DefaultsHelpFormatter)
    for title, cls in OPTION_CLASSES.items():
        group = p.add_argument_group(title)
        add_arguments(group, settings(cls))
        if cls is ServerConfig:
            group.add_argument("--api-key-file", help="read the API key from this file (its first line)")


def bench_parser(sub: argparse._SubParsersAction) -> None:
    from conveyor.bench import args as bench_args  # flags only: nothing heavy imports here

    p = sub.add_parser("bench", help="benchmarks: an HTTP load generator, offline throughput, scheduler step cost")
    which = p.add_subparsers(dest="bench", required=True)
    bench_args.add_serve(
        which.add_parser("serve", help="load an OpenAI-compatible server over HTTP: latency, throughput, effective throughput")
    )
    bench_args.add_offline(
        which.add_parser(
            "offline",
            help="offline tokens/s of conveyor's LLM API against transformers' generate",
            formatter_class=DefaultsHelpFormatter,
        )
    )
    bench_args.add_step(which.add_parser("step", help="CPU cost of one scheduler (or, --worker, worker) step over N running decodes"))
    bench_args.add_forward(
        which.add_parser("forward", help="one worker step on the CPU, with and without the C++ kernels, interleaved")
    )
    bench_args.add_roofline(
        which.add_parser("roofline", help="a decode step's ops on the cpu backend beside their memory-bandwidth roofline, per ISA")
    )
    bench_args.add_sampling(which.add_parser("sampling", help="the sampler's draw against noise-tensor draws, interleaved"))
    bench_args.add_cpu(
        which.add_parser(
            "cpu", help="run a client command; the CPU each stage spent per 1,000 output tokens, the client's, the bubble"
        )
    )


def router_parser(sub: argparse._SubParsersAction) -> None:
    """--backends or --backends-dns, then one flag per option() field of RouterConfig."""
    from conveyor.stages.replica_router.config import RouterConfig, parse_backends
    from conveyor.stages.replica_router.discovery import parse_dns_name

    p = sub.add_parser(
        "router",
        help="an HTTP router in front of several conveyor daemons: prefix affinity, then load",
        formatter_class=DefaultsHelpFormatter,
    )
    replicas = p.add_mutually_exclusive_group(required=True)
    replicas.add_argument(
        "--backends",
        type=parse_backends,
        metavar="URL[,URL...]",
        help="the daemons' base URLs, e.g. http://10.0.0.1:8000,http://10.0.0.2:8000",
    )
    replicas.add_argument(
        "--backends-dns",
        type=parse_dns_name,
        metavar="HOST:PORT",
        help="a name whose addresses are the daemons, asked again every --health-interval (a Kubernetes headless Service)",
    )
    add_arguments(p, settings(RouterConfig))


def router(args: argparse.Namespace) -> int:
    from conveyor.config.options import collect
    from conveyor.stages.replica_router.config import RouterConfig
    from conveyor.stages.replica_router.main import serve as serve_router

    fields = collect((RouterConfig,), {s.name: getattr(args, s.name) for s in settings(RouterConfig)})[RouterConfig]
    return serve_router(RouterConfig(backends=args.backends or (), backends_dns=args.backends_dns, **fields))


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
    if args.bench == "sampling":
        from conveyor.bench import sampling

        return sampling.main(args)
    if args.bench == "roofline":
        from conveyor.bench import roofline

        return roofline.main(args)
    if args.bench == "cpu":
        from conveyor.bench import stage_cpu

        return stage_cpu.main(args)
    if args.worker:
        from conveyor.bench import worker_cost

        return worker_cost.main(args.running)
    from conveyor.bench import scheduler_cost

    return scheduler_cost.main(args.running, prepare=args.prepare, device=args.device)


def serve(args: argparse.Namespace) -> int:
    from conveyor.stages.launcher import Launcher

    options = {s.name: getattr(args, s.name) for cls in OPTION_CLASSES.values() for s in settings(cls)}
    config = build_engine_config(**{**options, "api_key": resolve_api_key(args)})
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
    parser = argparse.ArgumentParser(prog="conveyor", description=" ".join((__doc__ or "").split("\n\n")[0].split()))
    sub = parser.add_subparsers(dest="command", required=True)
    serve_parser(sub)
    router_parser(sub)
    bench_parser(sub)
    args = parser.parse_args(argv)
    role = "router" if args.command == "router" else "launcher"
    logging.basicConfig(level=log_level().upper(), format=f"%(asctime)s %(levelname)s [{role}] %(message)s", datefmt="%H:%M:%S")
    commands = {"serve": serve, "router": router, "bench": bench}
    try:
        return commands[args.command](args)
    except ConfigError as e:
        print(f"conveyor: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
