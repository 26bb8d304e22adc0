"""`conveyor bench serve` against a fake OpenAI server (bench_fakes): a two-point sweep's JSON,
table and figures, --extra-body on every request, and an unreachable server."""

from __future__ import annotations

import json

import pytest

from conveyor import cli


def test_sweep_writes_json_and_figures(server, tmp_path, capsys):
    out, plots = tmp_path / "sweep.json", tmp_path / "plots"
    rc = cli.main(
        (
            f"bench serve --base-url {server.url} --dataset random --input-len 20 "
            "--output-len 3 --num-prompts 4 --sweep-clients 1,2 --disable-tqdm "
            f"--result-json {out} --plot-dir {plots}"
        ).split()
    )
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["model"] == "fake-model" and report["counter"] == "server /tokenize"
    assert [p["num_clients"] for p in report["points"]] == [1, 2]
    assert all(p["num_completed"] == 4 and p["num_failed"] == 0 for p in report["points"])
    assert all(p["mean_input_len"] == 20 and p["mean_output_len"] == 3 for p in report["points"])
    assert set(report["points"][0]["effective_throughput"]) == {"2", "4", "6"}
    for name in ("throughput_latency.png", "effective_throughput.png", "token_latency.png"):
        assert (plots / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(server.bodies) == 1 + 8  # the test request, then 4 per point
    table = capsys.readouterr().out
    assert "| 1 client" in table and "2 clients |" in table and "effective req/s (gen 4 tok/s)" in table


def test_extra_body_reaches_every_request(server, capsys):
    extra = {"response_format": {"type": "json_object"}, "temperature": 0.5}
    args = f"bench serve --base-url {server.url} --dataset random --input-len 8 --output-len 2 --num-prompts 3 --disable-tqdm"
    rc = cli.main([*args.split(), "--extra-body", json.dumps(extra)])
    assert rc == 0 and len(server.bodies) == 1 + 3
    assert all(body["response_format"] == {"type": "json_object"} and body["temperature"] == 0.5 for body in server.bodies)
    with pytest.raises(SystemExit):
        cli.main(["bench", "serve", "--extra-body", "[1]"])
    assert "must be a JSON object" in capsys.readouterr().err


def test_serve_reports_an_unreachable_server(capsys):
    rc = cli.main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--num-prompts", "2", "--disable-tqdm"])
    assert rc == 1 and "error" in capsys.readouterr().err
