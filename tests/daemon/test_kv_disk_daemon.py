"""The KV disk tier through the whole daemon: a restarted daemon whose host tier is smaller than
what its disk holds serves a repeated prompt with its prefix read from disk on the hit (the
worker's reads answered by KvFetched while the engine has nothing else to run), with the tokens
the first daemon computed; and of two daemons sharing one directory, one serves a prompt the
other computed after both started (its worker's looks reported by KvDiskChanged while idle)."""

from __future__ import annotations

import time

from tests.conftest import Daemon

PROMPT = "Tell me a long story about a river, a boat and a fox, and how the fox crossed. " * 3
OTHERS = [f"Count the stars of night number {i}, one by one, and name each of them as you go. " * 3 for i in range(3)]


def complete(daemon: Daemon, prompt: str) -> tuple[list[int], dict]:
    body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    r = daemon.post("/v1/completions", body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"], r.json()["usage"]


def test_a_restarted_daemon_reads_its_prefix_from_disk_on_a_hit(tmp_path):
    root = tmp_path / "kv"
    options = ("--block-size", "4", "--num-kv-blocks", "256", "--kv-disk-dir", str(root))
    first = Daemon(*options, "--kv-offloading-size", "0.01")
    try:
        expected, usage = complete(first, PROMPT)
        assert usage["prompt_tokens_details"]["cached_tokens"] == 0
        time.sleep(0.1)  # the prefix's files, older than the others'
        for prompt in OTHERS:  # newer blocks, which the next daemon's small host tier reads back at start-up
            complete(first, prompt)
        time.sleep(1.0)  # the writer thread's queue on disk
    finally:
        first.stop()
    files = list(root.rglob("*.kv"))
    num_blocks = (usage["prompt_tokens"] - 1) // 4  # those a prefix hit may cover
    num_slots = num_blocks + 2  # room for the prefix, and less than the disk holds
    assert len(files) > num_blocks + num_slots
    block_bytes = files[0].stat().st_size - 40  # the file's header (gpu/kv/disk_format.py)
    again = Daemon(*options, "--kv-offloading-size", str(num_slots * block_bytes / 2**30))
    try:
        tokens, usage = complete(again, PROMPT)
        assert tokens == expected
        assert usage["prompt_tokens_details"]["cached_tokens"] == 4 * num_blocks
        assert again.metric("conveyor_kv_disk_hits_total") == num_blocks
        assert again.metric("conveyor_kv_host_hits_total") == 0  # none of it was in the host tier
    finally:
        again.stop()


def test_a_daemon_reads_what_another_wrote_into_the_shared_directory_after_it_started(tmp_path):
    options = ("--block-size", "4", "--num-kv-blocks", "256", "--kv-disk-dir", str(tmp_path / "kv"), "--kv-offloading-size", "0.01")
    first = Daemon(*options)
    try:
        second = Daemon(*options, "--kv-disk-scan-s", "0.1")  # on the directory before the first computes anything
    except Exception:
        first.stop()
        raise
    try:
        expected, usage = complete(first, PROMPT)
        complete(first, OTHERS[0])  # its next plan writes the prompt's last saved blocks through
        time.sleep(1.5)  # the first's writer thread; then the second's looks (every 0.1 s), sent while it idles
        tokens, again = complete(second, PROMPT)
        assert tokens == expected
        num_blocks = (usage["prompt_tokens"] - 1) // 4  # those a prefix hit may cover
        assert again["prompt_tokens_details"]["cached_tokens"] == 4 * num_blocks
        assert second.metric("conveyor_kv_disk_hits_total") == num_blocks
    finally:
        second.stop()
        first.stop()
