"""`conveyor serve` with a bad checkpoint: one line on stderr and a non-zero exit."""

from __future__ import annotations

import json
import subprocess
import sys


def serve(*args: str) -> subprocess.CompletedProcess:
    """The tiny model unless `args` name one: the default is fetched from the package index."""
    model = () if "--model" in args else ("--model", "tiny")
    return subprocess.run(
        [sys.executable, "-m", "conveyor", "serve", "--device", "cpu", *model, *args], capture_output=True, text=True, timeout=60
    )


def test_missing_model_path(tmp_path):
    r = serve("--model", str(tmp_path / "nowhere"))
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "not a directory" in r.stderr


def test_directory_without_config(tmp_path):
    r = serve("--model", str(tmp_path))
    assert r.returncode == 2 and "config.json" in r.stderr and r.stderr.strip().count("\n") == 0


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    r = serve("--model", str(tmp_path))
    assert r.returncode == 2 and "unsupported architecture" in r.stderr and r.stderr.strip().count("\n") == 0


def test_bad_option_value():
    r = serve("--max-num-seqs", "0")
    assert r.returncode == 2 and "max-num-seqs" in r.stderr


def test_missing_api_key_file(tmp_path):
    r = serve("--api-key-file", str(tmp_path / "nope"))
    assert r.returncode == 2 and "API key file" in r.stderr and r.stderr.strip().count("\n") == 0


def test_a_hardening_limit_must_be_positive():
    r = serve("--drain-timeout", "0")
    assert r.returncode == 2 and "--drain-timeout must be positive" in r.stderr


def test_help_says_what_the_command_does_whole():
    """The description is the module docstring's first paragraph, not its first line."""
    out = subprocess.run([sys.executable, "-m", "conveyor", "--help"], capture_output=True, text=True, timeout=60).stdout
    assert " ".join(out.split()).count("runs the benchmarks (conveyor/bench).") == 1
