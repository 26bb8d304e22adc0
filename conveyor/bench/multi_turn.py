"""The multi-turn workload of `conveyor bench serve --dataset multi-turn`: ShareGPT conversations
replayed turn by turn, several at once, so that a KV cache has to keep conversations between turns.

Turns: a conversation's exchanges are its leading (human, gpt) pairs, both with text. Turn k sends
every earlier exchange and the k-th user message. The assistant's messages are what the server
generated for the earlier turns (`replies="generated"`, the default: what a chat client sends
back, so each turn's prompt is the previous turn's prompt + the reply the server computed + the
next user message, and a prefix cache that kept the previous turn finds all of it), or the
recorded ShareGPT replies (`"recorded"`: the same prompts whatever the server says, to compare
servers; the previous reply is then never a prefix hit). max_tokens is the recorded reply's length, capped. A
conversation stops before the first turn whose prompt and output would pass `max_context`
tokens; one left with fewer than two turns is not used. Conversations are taken in an order
shuffled by the seed, `num_prompts` of them (all there are, if fewer).

With `context_len` L > 0 every conversation opens with a system message of its own, L tokens of
random words (system_prompts.py's maker, from a seed stream of its own): the document, code base
or tool list an agent's or a RAG chat's turns all repeat. Prefill then weighs more in a turn's
time than ShareGPT's short exchanges let it, which is where a KV tier saves most; no two
conversations share it, so only the conversation's own KV hits.

Load (`replay`): `active` conversations are interleaved (the KV working set) and `concurrency`
clients serve them (the requests in flight, at most). A free client sends the next turn of the
active conversation that has waited longest, so a conversation never has two turns in flight and
its turns go in order; between two of them the other active conversations run, and push its KV
out of a pool smaller than the working set. A turn's conversation is ready again when it finished
(plus `think_time` seconds); one that ends hands its place to the next. Without `active` each
client keeps one conversation, a closed loop (active = concurrency). The working set is about
active x mean prompt tokens (the context a next turn extends): for W times a pool of P tokens
(the server's conveyor_kv_cache_capacity_tokens), active ~ W x P / mean prompt, while the
concurrency sets the queueing. `describe` prints both.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import math
import random
import time
from collections.abc import Awaitable, Callable

from conveyor.bench import client
from conveyor.bench.dataset import BenchRequest, DatasetConfig
from conveyor.bench.prompts import TokenCounter, special_tokens
from conveyor.bench.system_prompts import make_system_prompts

TOKENS_PER_MESSAGE = 8  # a chat template's role header and end marker, roughly (ChatML, Llama 3: ~5)
TARGET_WORKING_SET = 5.0  # x the KV pool: issue 50's "working set about 5x the device pool"
REPLIES = ("generated", "recorded")  # what a turn's assistant messages hold (replay)
CONTEXT_STREAM = 3  # the seed stream of the conversations' openings (system_prompts.py uses 1 and 2)

Message = tuple[str, str]  # (role, content)


@dataclasses.dataclass(frozen=True)
class MultiTurnConfig:
    concurrency: int = 16  # clients: turns in flight at most
    active: int | None = None  # conversations interleaved, the working set (None: concurrency, each a closed loop)
    think_time: float = 0.0  # seconds between a turn's end and its conversation's next turn
    max_output: int = 256  # cap on a turn's max_tokens
    max_context: int = 2000  # prompt + max_tokens a turn may reach: under a 2048-token model, with a margin
    replies: str = "generated"  # the assistant's turns: one of REPLIES (replay)
    context_len: int = 0  # tokens of each conversation's own opening system message (0: none)

    @property
    def num_active(self) -> int:
        return self.concurrency if self.active is None else self.active


@dataclasses.dataclass(frozen=True)
class Turn:
    messages: tuple[Message, ...]  # the chat so far: user, assistant, ..., ending with the user's
    prompt_len: int  # tokens, estimated: the messages' counts + TOKENS_PER_MESSAGE each (+ a BOS)
    output_len: int  # max_tokens: the recorded reply's tokens, capped
    system: str = ""  # the conversation's opening (MultiTurnConfig.context_len), before `messages`

    def request(self) -> BenchRequest:
        """The turn as the client's request: its last message, with the turn's lengths."""
        return BenchRequest(self.messages[-1][1], self.prompt_len, self.output_len)

    @property
    def transcript(self) -> str:
        """The messages as one completion prompt, joined by blank lines, so turn k+1's
        transcript extends turn k's as its chat does."""
        return "\n\n".join([self.system] * bool(self.system) + [content for _, content in self.messages])


Conversation = tuple[Turn, ...]


def exchanges(messages: list[dict]) -> list[tuple[str, str]]:
    """The leading (human, gpt) pairs of a ShareGPT conversation, up to the first out of turn or
    without text."""
    out = []
    for human, gpt in zip(messages[0::2], messages[1::2]):
        if (human.get("from"), gpt.get("from")) != ("human", "gpt") or not human.get("value") or not gpt.get("value"):
            break
        out.append((human["value"], gpt["value"]))
    return out


def read_exchanges(path: str) -> list[list[tuple[str, str]]]:
    """The exchanges of each conversation in a ShareGPT file that has at least two, in file order."""
    with open(path, encoding="utf-8") as f:
        entries = json.load(f)
    found = (exchanges(e.get("conversations") or []) for e in entries)
    return [pairs for pairs in found if len(pairs) >= 2]


def make_turns(pairs: list[tuple[str, str]], counts: list[tuple[int, int]], overhead: int, config: MultiTurnConfig) -> Conversation:
    """One conversation's turns, from its (user, reply) pairs and their token counts (each count
    with the counter's `overhead` special tokens, which a message inside a chat does not carry)."""
    messages: list[Message] = []
    context = overhead + (config.context_len + TOKENS_PER_MESSAGE if config.context_len else 0)  # the BOS, the opening
    turns = []
    for (user, reply), (num_user, num_reply) in zip(pairs, counts, strict=True):
        prompt_len = context + num_user - overhead + TOKENS_PER_MESSAGE
        output_len = max(1, min(num_reply - overhead, config.max_output))
        if prompt_len + output_len > config.max_context:
            break
        messages.append(("user", user))
        turns.append(Turn(tuple(messages), prompt_len, output_len))
        messages.append(("assistant", reply))
        # The next prompt holds this turn's reply: the server's (at most output_len tokens) or the file's.
        reply_len = output_len if config.replies == "generated" else num_reply - overhead
        context = prompt_len + reply_len + TOKENS_PER_MESSAGE
    return tuple(turns)


async def make_conversations(dataset: DatasetConfig, config: MultiTurnConfig, counter: TokenCounter) -> list[Conversation]:
    """`dataset.num_prompts` conversations of at least two turns each, in the seed's order."""
    if dataset.path is None:
        raise ValueError("the multi-turn dataset needs --dataset-path (a ShareGPT JSON file)")
    found = read_exchanges(dataset.path)
    order = list(range(len(found)))
    random.Random(dataset.seed).shuffle(order)
    overhead = await special_tokens(counter)
    kept: list[Conversation] = []
    while order and len(kept) < dataset.num_prompts:
        wanted = dataset.num_prompts - len(kept) + 8  # a few more: some fall short of two turns
        chunk, order = order[:wanted], order[wanted:]
        counts = iter(await counter.count([text for i in chunk for pair in found[i] for text in pair]))
        for i in chunk:
            turns = make_turns(found[i], [(next(counts), next(counts)) for _ in found[i]], overhead, config)
            if len(turns) >= 2 and len(kept) < dataset.num_prompts:
                kept.append(turns)
    if config.context_len and kept:
        openings = await make_system_prompts(len(kept), config.context_len, dataset.seed, counter, stream=CONTEXT_STREAM)
        kept = [tuple(dataclasses.replace(t, system=text) for t in turns) for turns, text in zip(kept, openings, strict=True)]
    return kept


def payload(turn: Turn, model: str, *, chat: bool, ignore_eos: bool, return_token_ids: bool) -> dict:
    """The client's body for a turn: the chat so far as messages, or as a transcript for a
    completion endpoint."""
    body = client.payload(turn.request(), model, chat=chat, ignore_eos=ignore_eos, return_token_ids=return_token_ids)
    if chat:
        opening = [{"role": "system", "content": turn.system}] if turn.system else []
        body["messages"] = opening + [{"role": role, "content": content} for role, content in turn.messages]
    else:
        body["prompt"] = turn.transcript
    return body


class _Chat:
    """An active conversation: its turns and the replies its earlier turns got."""

    def __init__(self, conversation: Conversation) -> None:
        self.conversation = conversation
        self.said: list[Message] = []  # the assistant's turns so far: the server's, or the recorded ones

    @property
    def done(self) -> bool:
        return len(self.said) == len(self.conversation)

    def next_turn(self, replies: str) -> Turn:
        """The next turn, whose assistant messages (the odd ones) are this run's replies when
        `replies` is "generated"."""
        turn = self.conversation[len(self.said)]
        if replies == "generated" and self.said:
            messages = tuple(self.said[i // 2] if i % 2 else m for i, m in enumerate(turn.messages))
            turn = dataclasses.replace(turn, messages=messages)
        return turn

    def took(self, result: client.RequestResult) -> None:
        """The next turn finished: its reply is the text the server gave, or the recorded one."""
        k = len(self.said)  # its recorded reply is the next turn's message 2k + 1
        following = self.conversation[k + 1].messages if k + 1 < len(self.conversation) else ()
        recorded = following[2 * k + 1] if len(following) > 2 * k + 1 else ("assistant", "")
        self.said.append(("assistant", result.text) if result.success and result.text else recorded)


async def replay(
    conversations: list[Conversation],
    send: Callable[[Turn], Awaitable[client.RequestResult]],
    *,
    concurrency: int,
    active: int | None = None,
    think_time: float = 0.0,
    progress=None,
    replies: str = "generated",
) -> tuple[list[client.RequestResult], float]:
    """Every turn's result, in the order they finished, and the run's duration (first send to last
    finish): `active` conversations interleaved (None: `concurrency`), `concurrency` clients each
    sending the next turn of the conversation that has waited longest, a conversation ready again
    `think_time` seconds after its turn finished. `replies`: "generated", each assistant turn is
    the text the server streamed for it, as a chat client sends it back (a failed turn's is the
    recorded reply); "recorded", the ShareGPT replies, the same prompts whatever the server says
    (to compare servers)."""
    if replies not in REPLIES:
        raise ValueError(f"replies: one of {REPLIES}, not {replies!r}")
    num_active = concurrency if active is None else active
    if concurrency < 1 or num_active < 1:
        raise ValueError("multi-turn needs at least one client and one active conversation")
    if think_time < 0:
        raise ValueError("the think time cannot be negative")
    loop = asyncio.get_running_loop()
    pending = iter(conversations)  # a conversation that ends hands its place to the next
    ready: asyncio.Queue[_Chat | None] = asyncio.Queue()  # first in, first out: the longest wait first
    for conversation in itertools.islice(pending, num_active):
        ready.put_nowait(_Chat(conversation))
    num_clients = min(concurrency, num_active)  # a client more than the conversations would never send
    num_open = ready.qsize()  # conversations not done: ready, in flight or thinking
    results: list[client.RequestResult] = []

    def close() -> None:
        nonlocal num_open
        if (following := next(pending, None)) is not None:
            ready.put_nowait(_Chat(following))
            return
        num_open -= 1
        if num_open == 0:  # the last turn finished: every client stops
            for _ in range(num_clients):
                ready.put_nowait(None)

    async def serve() -> None:
        while (chat := await ready.get()) is not None:
            result = await send(chat.next_turn(replies))
            results.append(result)
            if progress is not None:
                progress.update(1)
            chat.took(result)
            if chat.done:
                close()
            elif think_time > 0:
                loop.call_later(think_time, ready.put_nowait, chat)
            else:
                ready.put_nowait(chat)

    if num_open == 0:
        return results, 0.0
    start = time.perf_counter()
    async with asyncio.TaskGroup() as clients:  # a client that raises cancels the others
        for _ in range(num_clients):
            clients.create_task(serve())
    return results, time.perf_counter() - start


def describe(conversations: list[Conversation], config: MultiTurnConfig, pool_tokens: float | None) -> str:
    """The workload in two lines, with the working set it keeps against the server's KV pool."""
    turns = [t for c in conversations for t in c]
    prompt = sum(t.prompt_len for t in turns) / len(turns)
    output = sum(t.output_len for t in turns) / len(turns)
    active = min(config.num_active, len(conversations))
    clients = min(config.concurrency, active)
    working_set = active * prompt
    think = f", {config.think_time:g} s between turns" if config.think_time else ""
    opening = f", each opening with ~{config.context_len} tokens of its own" if config.context_len else ""
    text = (
        f"dataset multi-turn: {len(conversations)} conversations, {len(turns)} turns ({len(turns) / len(conversations):.1f} each), "
        f"mean prompt ~{prompt:.0f} / max output {output:.0f} tokens{opening}\n"
        f"{active} conversations interleaved by {clients} clients{think}: working set ~{working_set:.0f} tokens"
    )
    if pool_tokens:
        suggest = math.ceil(TARGET_WORKING_SET * pool_tokens / prompt)
        text += (
            f" = {working_set / pool_tokens:.1f}x the server's KV pool of {pool_tokens:.0f} tokens "
            f"({TARGET_WORKING_SET:g}x: --multi-turn-active {suggest})"
        )
    return text
