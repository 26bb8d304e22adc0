"""Prompt chunks never end inside an image whose placeholders attend to each other (Gemma 3:
ImageInput.bidirectional), while they may cut a causal image (LLaVA, Qwen2-VL); a chunk that
starts inside one (after a prefix-cache hit) waits until the rest of it fits. Pure Python,
through the Scheduler with the fake worker."""

from __future__ import annotations

from conveyor.stages.scheduler.sequence import Sequence
from conveyor.wire.images import ImageInput
from conveyor.wire.messages import SamplingParams
from tests.scheduler.test_scheduler import make, prompt_of, step_once


def image(offset: int, length: int, bidirectional: bool, key: int = 1) -> ImageInput:
    return ImageInput(hash=key, offset=offset, length=length, pixels=b"", shape=[0], bidirectional=bidirectional)


def seq_with(i: int, prompt_len: int, images: list[ImageInput]) -> Sequence:
    return Sequence(i, f"req-{i}", prompt_of(i, prompt_len), SamplingParams(max_tokens=4), images=images)


def test_num_chunk_tokens_stops_before_a_bidirectional_image():
    s = seq_with(0, 60, [image(10, 16, True), image(30, 16, False, key=2)])
    assert s.num_chunk_tokens(0, 20) == 10  # would end at 20, inside [10, 26)
    assert s.num_chunk_tokens(0, 26) == 26  # ends right after it
    assert s.num_chunk_tokens(10, 16) == 16
    assert s.num_chunk_tokens(0, 8) == 8  # ends before it
    assert s.num_chunk_tokens(26, 10) == 10  # inside the causal image at [30, 46): allowed
    assert s.num_chunk_tokens(14, 4) == 0  # starts inside it (a prefix hit) and cannot finish it


def test_the_scheduler_chunks_around_the_image():
    sched, runner = make(budget=20)
    sched.add(seq_with(0, 40, [image(10, 16, True)]))
    chunks = []
    while True:
        step, _ = step_once(sched, runner)
        if step is None or all(row.seq.num_computed_tokens > 40 for row in step.rows):
            break
        chunks.append([row.num_tokens for row in step.rows])
    assert chunks[:3] == [[10], [20], [10]]  # up to the image; the image and 4 more; the rest


def test_a_causal_image_is_cut_by_the_budget():
    sched, runner = make(budget=20)
    sched.add(seq_with(0, 40, [image(10, 16, False)]))
    step, _ = step_once(sched, runner)
    assert step is not None and [row.num_tokens for row in step.rows] == [20]


def test_a_chunk_that_cannot_take_the_image_waits_for_room():
    """A decode takes one token of a 20-token budget: the next prompt's chunk would end inside its
    16-token image [4, 20) at 19 and stops before it, at 4; the next one takes the image whole."""
    sched, runner = make(budget=20)
    sched.add(seq_with(0, 4, []))
    step_once(sched, runner)  # its prompt: it decodes from now on
    sched.add(seq_with(1, 40, [image(4, 16, True)]))
    step, _ = step_once(sched, runner)
    assert step is not None and sorted(row.num_tokens for row in step.rows) == [1, 4]
    step, _ = step_once(sched, runner)
    assert step is not None and sorted(row.num_tokens for row in step.rows) == [1, 19]
