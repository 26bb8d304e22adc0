"""conveyor bench serve's multi-turn workload (conveyor/bench/multi_turn.py): each turn's prompt is
the previous turn's prompt + its recorded reply + the next user message, conversations are closed
loops of which N are active at once, and a run against a fake server whose /metrics tell a KV pool
and host-tier hits reports both, on the chat endpoint and as completion transcripts."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import time
from collections.abc import Callable

import pytest
from aiohttp import web

from conveyor import cli
from conveyor.bench.client import RequestResult
from conveyor.bench.dataset import DatasetConfig
from conveyor.bench.multi_turn import (
    TOKENS_PER_MESSAGE,
    MultiTurnConfig,
    Turn,
    exchanges,
    make_conversations,
    make_turns,
    payload,
    read_exchanges,
    replay,
)
from tests.ops.bench_fakes import SHAREGPT, FakeServer


def test_each_turn_extends_the_last_by_its_recorded_reply(tiny_counter):
    config = MultiTurnConfig(max_output=64, max_context=1500)
    dataset = DatasetConfig("multi-turn", 12, path=SHAREGPT, seed=3)
    conversations = asyncio.run(make_conversations(dataset, config, tiny_counter))
    replies = {pairs[0][0]: [reply for _, reply in pairs] for pairs in read_exchanges(SHAREGPT)}
    assert len(conversations) == 12 and all(len(c) >= 2 for c in conversations)
    for turns in conversations:
        recorded = replies[turns[0].messages[0][1]]
        assert turns[0].messages[0][0] == "user" and len(turns[0].messages) == 1
        for k, (last, turn) in enumerate(zip(turns, turns[1:])):
            assert turn.messages[: len(last.messages)] == last.messages
            assert [role for role, _ in turn.messages[len(last.messages) :]] == ["assistant", "user"]
            assert turn.messages[len(last.messages)][1] == recorded[k]  # the file's reply, not the server's
            assert turn.transcript.startswith(last.transcript + "\n\n" + recorded[k] + "\n\n")
            assert turn.prompt_len > last.prompt_len
        assert all(1 <= t.output_len <= 64 and t.prompt_len + t.output_len <= 1500 for t in turns)
    assert asyncio.run(make_conversations(dataset, config, tiny_counter)) == conversations
    other = asyncio.run(make_conversations(DatasetConfig("multi-turn", 12, path=SHAREGPT, seed=4), config, tiny_counter))
    assert [c[0].messages for c in other] != [c[0].messages for c in conversations]


def test_each_conversation_opens_with_a_context_of_its_own(tiny_counter):
    """--multi-turn-context-len: every turn of a conversation repeats one opening of about that many
    tokens (counted in its prompt length), no two conversations share theirs, and the turns after
    it are those without one."""
    config = MultiTurnConfig(max_output=64, max_context=1500)
    dataset = DatasetConfig("multi-turn", 6, path=SHAREGPT, seed=3)
    plain = asyncio.run(make_conversations(dataset, config, tiny_counter))
    opened = asyncio.run(make_conversations(dataset, dataclasses.replace(config, context_len=300), tiny_counter))
    openings = [turns[0].system for turns in opened]
    assert len(set(openings)) == len(opened) == 6 and all(openings)
    for turns in opened:
        assert {t.system for t in turns} == {turns[0].system}
        assert all(t.transcript.startswith(t.system + "\n\n") for t in turns)
        body = payload(turns[1], "m", chat=True, ignore_eos=False, return_token_ids=False)
        assert body["messages"][0] == {"role": "system", "content": turns[0].system} and len(body["messages"]) == 4
    for counted in asyncio.run(tiny_counter.count(openings)):
        assert abs(counted - 1 - 300) <= 2  # its BOS aside, about the length asked for
    for a, b in zip(plain, opened):  # the same turns where both fit, 300 + a message's overhead longer
        for x, y in zip(a, b):
            assert x.messages == y.messages and y.prompt_len == x.prompt_len + 300 + TOKENS_PER_MESSAGE
        assert len(b) <= len(a) and all(t.prompt_len + t.output_len <= 1500 for t in b)


def test_turn_lengths_and_where_a_conversation_stops():
    pairs = [("a b", "c d e"), ("f", "g h"), ("i j k", "l")]
    counts = [(3, 4), (2, 300), (4, 2)]  # each with one special token (a BOS), as a counter gives them
    turns = make_turns(pairs, counts, overhead=1, config=MultiTurnConfig(max_output=100, max_context=10_000))
    first = 1 + 2 + TOKENS_PER_MESSAGE
    second = first + 3 + TOKENS_PER_MESSAGE + 1 + TOKENS_PER_MESSAGE
    assert [t.prompt_len for t in turns[:2]] == [first, second]
    assert [t.output_len for t in turns] == [3, 100, 1]  # the reply's tokens, capped at max_output
    assert turns[2].messages == (("user", "a b"), ("assistant", "c d e"), ("user", "f"), ("assistant", "g h"), ("user", "i j k"))
    short = make_turns(pairs, counts, overhead=1, config=MultiTurnConfig(max_output=100, max_context=second + 99))
    assert len(short) == 1  # turn 2's prompt + 100 output tokens would pass the context
    # Recorded replies: turn 3's prompt holds turn 2's 299-token reply, not the 100 the server may say.
    kept = make_turns(pairs, counts, overhead=1, config=MultiTurnConfig(max_output=100, max_context=10_000, replies="recorded"))
    assert kept[2].prompt_len - turns[2].prompt_len == 299 - 100


def test_exchanges_stop_at_the_first_out_of_turn_or_empty_message():
    human, gpt = ({"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"})
    assert exchanges([human, gpt, human, gpt, human]) == [("hi", "hello")] * 2  # no reply: not a turn
    assert exchanges([human, gpt, gpt, human, human, gpt]) == [("hi", "hello")]
    assert exchanges([human, gpt, {"from": "human", "value": ""}, gpt]) == [("hi", "hello")]
    found = read_exchanges(SHAREGPT)
    assert all(len(pairs) >= 2 for pairs in found) and len(found) == 433  # 434 have two human turns; one goes out of turn


def _conversations(num: int) -> list[tuple[Turn, ...]]:
    """Conversation c has 2 + c % 3 turns, each named "c.k" by its user message."""
    return [tuple(Turn((("user", f"{c}.{k}"),), 10, 1) for k in range(2 + c % 3)) for c in range(num)]


def _recorder(delay: Callable[[str], float]):
    """A send that logs ("send" | "done", name) events and the turns in flight at each send."""
    events: list[tuple[str, str]] = []
    in_flight: list[str] = []
    most = [0]

    async def send(turn: Turn) -> RequestResult:
        name = turn.messages[-1][1]
        assert name.split(".")[0] not in {n.split(".")[0] for n in in_flight}, f"{name}: its conversation has a turn in flight"
        in_flight.append(name)
        most[0] = max(most[0], len(in_flight))
        events.append(("send", name))
        await asyncio.sleep(delay(name))
        in_flight.remove(name)
        events.append(("done", name))
        return RequestResult(10, 1, 0.0)

    return send, events, most


def _assert_each_turn_once_in_order(conversations, events) -> None:
    sent = [name for kind, name in events if kind == "send"]
    assert sorted(sent) == sorted(t.messages[-1][1] for c in conversations for t in c)  # every turn, once
    for c, turns in enumerate(conversations):
        for k in range(1, len(turns)):
            assert events.index(("send", f"{c}.{k}")) > events.index(("done", f"{c}.{k - 1}"))


def test_replay_without_active_keeps_each_client_a_closed_loop():
    conversations = _conversations(7)
    send, events, most = _recorder(lambda name: 0.001 * (1 + int(name.split(".")[0]) % 4))
    results, duration = asyncio.run(replay(conversations, send, concurrency=3))
    assert len(results) == sum(len(c) for c in conversations) and duration > 0
    assert most[0] == 3
    assert [name for kind, name in events[:3]] == ["0.0", "1.0", "2.0"]  # three conversations open at once
    opened = [name for kind, name in events if kind == "send" and name.endswith(".0")]
    assert opened == [f"{c}.0" for c in range(7)]  # one that ends hands its place to the next
    _assert_each_turn_once_in_order(conversations, events)
    with pytest.raises(ValueError):
        asyncio.run(replay(conversations, send, concurrency=0))
    with pytest.raises(ValueError):
        asyncio.run(replay(conversations, send, concurrency=2, active=0))


def test_replay_interleaves_active_conversations_round_robin():
    """12 active conversations of 4 turns, 3 clients, turns that take one loop pass each: every
    conversation's turn k goes before any turn k + 1, in the same order (the longest waiting
    first), so between two turns of one conversation the 11 others run."""
    conversations = [tuple(Turn((("user", f"{c}.{k}"),), 10, 1) for k in range(4)) for c in range(12)]
    send, events, most = _recorder(lambda name: 0)
    results, _ = asyncio.run(replay(conversations, send, concurrency=3, active=12))
    assert len(results) == 48 and most[0] == 3
    assert [name for kind, name in events if kind == "send"] == [f"{c}.{k}" for k in range(4) for c in range(12)]


def test_replay_hands_an_ended_conversations_place_to_the_next():
    """Conversations of 2 to 4 turns, 8 active of 20, 3 clients, unequal turn times: never two
    turns of one conversation in flight, at most 3 in flight, each conversation's turns in order,
    every turn once; the first 8 conversations open before any goes on, the others in order."""
    conversations = _conversations(20)
    send, events, most = _recorder(lambda name: 0.001 * (1 + int(name.split(".")[0]) % 4))
    results, _ = asyncio.run(replay(conversations, send, concurrency=3, active=8))
    assert len(results) == sum(len(c) for c in conversations)
    assert most[0] == 3
    sent = [name for kind, name in events if kind == "send"]
    assert sent[:8] == [f"{c}.0" for c in range(8)]
    assert [name for name in sent if name.endswith(".0")] == [f"{c}.0" for c in range(20)]
    _assert_each_turn_once_in_order(conversations, events)


def test_replay_with_more_clients_than_conversations_and_think_time():
    conversations = _conversations(3)  # 2, 3 and 4 turns
    send, events, most = _recorder(lambda name: 0.001)
    results, duration = asyncio.run(replay(conversations, send, concurrency=8, active=2, think_time=0.03))
    assert len(results) == sum(len(c) for c in conversations)
    assert most[0] == 2  # the clients beyond the active conversations never send
    _assert_each_turn_once_in_order(conversations, events)
    assert duration >= 4 * 0.03  # conversation 2 opens after conversation 0's wait, then waits 3 times
    with pytest.raises(ValueError):
        asyncio.run(replay(conversations, send, concurrency=1, think_time=-1))


def test_replay_waits_out_the_think_time_between_turns():
    conversations = _conversations(4)
    times: dict[str, float] = {}

    async def send(turn: Turn) -> RequestResult:
        name = turn.messages[-1][1]
        times["send " + name] = time.perf_counter()
        await asyncio.sleep(0.001)
        times["done " + name] = time.perf_counter()
        return RequestResult(10, 1, 0.0)

    asyncio.run(replay(conversations, send, concurrency=4, active=4, think_time=0.05))
    for c, turns in enumerate(conversations):
        for k in range(1, len(turns)):
            assert times[f"send {c}.{k}"] - times[f"done {c}.{k - 1}"] >= 0.05 * 0.9  # the loop's timer granularity


class TieredFake(FakeServer):
    """The fake server with a KV pool gauge and a host-tier counter: one host hit per follow-up turn."""

    POOL_TOKENS = 512

    async def metrics(self, request: web.Request) -> web.Response:
        text = (await super().metrics(request)).text or ""
        host_hits = sum(len(b.get("messages", [])) > 1 or "\n\n" in b.get("prompt", "") for b in self.bodies)
        text += f'# TYPE conveyor_kv_cache_capacity_tokens gauge\nconveyor_kv_cache_capacity_tokens{{engine="0"}} {self.POOL_TOKENS}\n'
        text += f'# TYPE conveyor_kv_host_hits counter\nconveyor_kv_host_hits_total{{engine="0"}} {host_hits}.0\n'
        return web.Response(text=text, content_type="text/plain")


@pytest.fixture(scope="module")
def tiered():
    server = TieredFake()
    yield server
    server.stop()


def _run(server: FakeServer, *flags: str) -> int:
    server.reset()
    args = f"bench serve --base-url {server.url} --dataset multi-turn --dataset-path {SHAREGPT} --num-prompts 5 --disable-tqdm"
    return cli.main([*args.split(), "--multi-turn-max-output", "2", "--multi-turn-max-context", "1200", *flags])


def test_serve_replays_conversations_on_the_chat_endpoint(tiered, tmp_path, capsys):
    out = tmp_path / "multi.json"
    lookups_before = sum(tiered.cache_counts["queries"]) + 1  # the counts run on; the test request looks up 1 block
    assert _run(tiered, "--multi-turn-concurrency", "2", "--result-json", str(out)) == 0
    bodies = tiered.bodies[1:]  # after the test request
    by_conversation = collections.defaultdict(list)
    for body in bodies:
        assert body["stream"] and body["max_tokens"] <= 2
        by_conversation[body["messages"][0]["content"]].append(body["messages"])
    assert len(by_conversation) == 5
    for sent in by_conversation.values():
        assert [len(m) for m in sent] == list(range(1, 2 * len(sent), 2))  # turn by turn, in order
        assert all(b[: len(a)] == a for a, b in zip(sent, sent[1:]))
    point = json.loads(out.read_text())["points"][0]
    assert point["num_completed"] == len(bodies) and point["num_failed"] == 0 and point["num_clients"] == 2
    assert point["prefix_cache_hit_rate"] > 0.5  # the fake's cache keeps each conversation so far
    follow_ups = len(bodies) - 5  # the fake counts one host hit for each
    assert point["kv_host_hit_rate"] == pytest.approx(follow_ups / (sum(tiered.cache_counts["queries"]) - lookups_before))
    stdout = capsys.readouterr().out
    assert "/v1/chat/completions" in stdout and "5 conversations" in stdout
    assert "x the server's KV pool of 512 tokens" in stdout and "--multi-turn-active" in stdout
    assert "| hits from the KV host tier (server)" in stdout


def test_serve_sends_transcripts_to_a_completion_endpoint(tiered):
    assert _run(tiered, "--endpoint", "/v1/completions", "--multi-turn-concurrency", "3") == 0
    prompts = [body["prompt"] for body in tiered.bodies[1:]]
    followed = [p for p in prompts if any(q != p and p.startswith(q + "\n\n") for q in prompts)]
    assert len(prompts) > 10 and len(followed) == len(prompts) - 5  # every turn but the first extends one


def test_serve_interleaves_active_conversations_by_fewer_clients(tiered, tmp_path, capsys):
    out = tmp_path / "multi.json"
    flags = ("--multi-turn-active", "4", "--multi-turn-concurrency", "2", "--multi-turn-think-time", "0.01")
    assert _run(tiered, *flags, "--result-json", str(out)) == 0
    first = [body["messages"][0]["content"] for body in tiered.bodies[1:]]
    assert len(set(first[:4])) == 4  # four conversations open before any goes on
    assert json.loads(out.read_text())["points"][0]["num_clients"] == 2
    assert "4 conversations interleaved by 2 clients, 0.01 s between turns" in capsys.readouterr().out


def test_serve_refuses_open_loop_flags_with_multi_turn(tiered, capsys):
    assert _run(tiered, "--sweep-clients", "1,2") == 1
    assert "--multi-turn-active" in capsys.readouterr().err
    for bad in (["--multi-turn-concurrency", "0"], ["--multi-turn-active", "0"], ["--multi-turn-think-time", "-1"]):
        with pytest.raises(SystemExit):
            cli.main(["bench", "serve", *bad])


@pytest.mark.parametrize("replies", ["generated", "recorded"])
def test_a_turn_sends_back_the_reply_the_server_gave(replies):
    """Generated replies: turn k+1's assistant messages are the texts the server streamed for the
    turns before (a failed turn's is the recorded reply); recorded: the file's, whatever the server said."""
    recorded = [("user", "u0"), ("assistant", "r0"), ("user", "u1"), ("assistant", "r1"), ("user", "u2")]
    conversation = tuple(Turn(tuple(recorded[: 2 * k + 1]), 10, 1) for k in range(3))
    sent: list[tuple[tuple[str, str], ...]] = []

    async def send(turn: Turn) -> RequestResult:
        sent.append(turn.messages)
        k = len(sent) - 1
        return RequestResult(10, 1, 0.0, text=f"said{k}", error="boom" if k == 1 else None)

    asyncio.run(replay([conversation], send, concurrency=1, replies=replies))
    assistants = [[text for role, text in messages if role == "assistant"] for messages in sent]
    if replies == "generated":
        assert assistants == [[], ["said0"], ["said0", "r1"]]  # turn 1 failed: its recorded reply stands
    else:
        assert assistants == [[], ["r0"], ["r0", "r1"]]
    assert [m[-1] for m in sent] == [("user", "u0"), ("user", "u1"), ("user", "u2")]
