"""`conveyor serve`'s flags are generated from the config fields' option() declarations: every
flag keeps its name, default, type and --no- form, --help shows the defaults, and
build_engine_config takes the same names, checked against the fields."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from conveyor import cli
from conveyor.config import (
    ConfigError,
    EngineConfig,
    SchedulerConfig,
    SchedulingPolicy,
    ServerConfig,
    config_from_json,
    config_to_json,
)
from conveyor.config.engine_options import OPTION_CLASSES
from conveyor.config.options import settings
from conveyor.engine_config import build_engine_config

# Every flag `conveyor serve` had before the flags were generated; none may disappear.
FLAGS = """model served-model-name host port dtype device max-model-len block-size num-kv-blocks kv-cache-gib
gpu-memory-utilization max-num-batched-tokens max-num-seqs scheduling-policy enable-prefix-caching
no-enable-prefix-caching async-scheduling no-async-scheduling max-queued-requests max-queued-tokens
tensor-parallel-size api-key api-key-file chat-content-special-tokens max-seqs-per-request http-header-timeout
http-body-timeout http-keepalive-timeout http-max-keepalive-requests max-connections stage-timeout drain-timeout
max-engine-restarts restart-window allowed-origins chat-template ingress-workers tokenizer-workers
detokenizer-workers data-parallel-size routing-policy ray-address""".split()


def serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    cli.serve_parser(parser.add_subparsers(dest="command"))
    return parser


def serve_action(flag: str) -> argparse.Action:
    (sub,) = [a for a in serve_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices["serve"]._option_string_actions[flag]


def test_every_flag_is_kept():
    (sub,) = [a for a in serve_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    flags = {f.removeprefix("--") for f in sub.choices["serve"]._option_string_actions if f.startswith("--")}
    assert set(FLAGS) <= flags


def test_flag_defaults_are_the_fields_defaults():
    args = serve_parser().parse_args(["serve"])
    for cls in OPTION_CLASSES.values():
        for s in settings(cls):
            field_default = {f.name: f.default for f in dataclasses.fields(cls)}[s.field]
            assert getattr(args, s.name) == (list(field_default) if s.type is tuple else field_default), s.flag
    assert (args.max_num_seqs, args.scheduling_policy, args.host, args.max_queued_tokens) == (256, "splitfuse", "127.0.0.1", 1 << 20)


def test_flag_types_choices_and_switches():
    parse = serve_parser().parse_args
    args = parse(
        (
            "serve --max-num-seqs 8 --gpu-memory-utilization 0.5 "
            "--no-enable-prefix-caching --chat-content-special-tokens "
            "--allowed-origins a b --scheduling-policy orca"
        ).split()
    )
    assert (args.max_num_seqs, args.gpu_memory_utilization, args.enable_prefix_caching) == (8, 0.5, False)
    assert args.chat_content_special_tokens and args.allowed_origins == ["a", "b"] and args.scheduling_policy == "orca"
    assert isinstance(serve_action("--async-scheduling"), argparse.BooleanOptionalAction)
    assert serve_action("--scheduling-policy").choices == ("splitfuse", "prefill_first", "orca")
    assert serve_action("--dtype").choices == ("auto", "float32", "float16", "bfloat16")
    with pytest.raises(SystemExit):
        parse(["serve", "--scheduling-policy", "fifo"])


def test_help_shows_defaults(capsys):
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for shown in (
        "sequences running at once (default: 256)",
        "(default: splitfuse)",
        "(default: from free memory)",
        "(0: no bound) (default: 1024)",
        "(default: smollm2: SmolLM2-135M-Instruct",
        "--api-key-file",
    ):
        assert shown in text


def test_serve_passes_every_flag_through(monkeypatch):
    built = {}

    class Launcher:
        def __init__(self, config):
            built["config"] = config

        def serve(self):
            return 0

    monkeypatch.setattr("conveyor.stages.launcher.Launcher", Launcher)
    monkeypatch.delenv("CONVEYOR_API_KEY", raising=False)
    assert (
        cli.main(
            (
                "serve --model tiny --device cpu --max-num-seqs 8 --scheduling-policy orca "
                "--no-async-scheduling --max-queued-tokens 0 --kv-cache-gib 0.25 "
                "--http-header-timeout 3 --chat-content-special-tokens --ingress-workers 2 "
                "--allowed-origins * --api-key k"
            ).split()
        )
        == 0
    )
    c = built["config"]
    assert (c.scheduler.max_num_seqs, c.scheduler.policy, c.scheduler.async_scheduling) == (8, "orca", False)
    assert (c.scheduler.max_queued_tokens, c.scheduler.max_queued_requests) == (None, 1024)
    assert (c.cache.cpu_kv_cache_gib, c.server.header_timeout_s, c.server.special_tokens_in_content) == (0.25, 3, True)
    assert (c.stages.num_ingress, c.server.allowed_origins, c.server.api_key, c.parallel.device) == (2, ("*",), "k", "cpu")


def test_build_takes_the_flag_names_and_checks_them():
    with pytest.raises(ConfigError, match="unknown options: bogus, max_seqs$"):
        build_engine_config(device="cpu", max_seqs=3, bogus=1)
    for options, message in (
        ({"max_num_seqs": 0}, "--max-num-seqs must be at least 1, got 0"),
        ({"max_queued_requests": -1}, "--max-queued-requests must be 0 \\(no bound\\) or more"),
        ({"stage_timeout": 0.0}, "--stage-timeout must be positive"),
        ({"scheduling_policy": "fifo"}, "--scheduling-policy must be one of splitfuse, prefill_first, orca"),
        ({"device": "tpu"}, "--device must be one of auto, cpu, cuda"),
        ({"data_parallel_size": 0}, "--data-parallel-size must be at least 1, got 0"),
        ({"routing_policy": "random"}, "--routing-policy must be one of cache_aware, round_robin, least_loaded"),
    ):
        with pytest.raises(ConfigError, match=message):
            build_engine_config("tiny", **options)


def test_build_leaves_unset_options_at_the_field_defaults():
    config = build_engine_config("tiny", device="cpu", max_num_seqs=None, max_queued_requests=0, scheduling_policy="orca")
    assert config.scheduler == SchedulerConfig(max_queued_requests=None, policy=SchedulingPolicy.ORCA)
    assert config.server == ServerConfig()


def test_the_policy_enum_round_trips_and_compares_as_its_name():
    config = build_engine_config("tiny", device="cpu", scheduling_policy="prefill_first")
    assert b'"policy":"prefill_first"' in config_to_json(config)
    back = config_from_json(config_to_json(config))
    assert isinstance(back, EngineConfig) and back == config
    assert back.scheduler.policy is SchedulingPolicy.PREFILL_FIRST and back.scheduler.policy == "prefill_first"
