"""The host's counts after a pass is launched, before its ids land, where forks meet drafts:
each row moves past the tokens it computed (a verifying row past its own token alone, until its
result says how many drafts held), each drawing row knows one more token, a fork becomes a copy
of its parent after the pass with its own draw, and the draws that are a row's next input are
fed back into the persistent batch on the device.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from conveyor.gpu.sampling.draws import DeviceSamples
from conveyor.gpu.sampling.transfer import to_device
from conveyor.gpu.step.passes import PassWork, WorkerSeq
from conveyor.gpu.step.persistent_batch import PersistentBatch


def advance(
    work: PassWork,
    samples: DeviceSamples | None,
    param_slots: torch.Tensor | None,
    batch: PersistentBatch,
    adopt: Callable[[WorkerSeq], None],
) -> list[WorkerSeq]:
    """Apply `work`'s pass to the host's counts and feed its draws back; `adopt` registers a
    fork's new sequence. The sequence of each draw, in draw order."""
    rows = work.rows
    for i, (seq, n) in enumerate(zip(rows, work.num_new)):
        seq.num_computed += n - len(work.drafts.get(i, ()))  # a verifying row: its token alone until collected
    for i in work.sampling:
        rows[i].num_tokens += 1
    if samples is None:
        return []
    assert param_slots is not None
    if not any(work.forks) and not work.drafts:  # each draw is its own row's: the slots are the parameters'
        batch.feed_back(param_slots, samples.token_ids)
        return [rows[i] for i in work.sampling]
    # A verifying row draws once per draft and once more; none of those is fed back (the host
    # gives its next input, once it knows which draws held: the runner waits for it).
    draw_seqs: list[WorkerSeq] = []
    draw_slots, fed = [], []  # each fed-back draw's slot, and its index among the draws
    for i, forks in zip(work.sampling, work.forks):
        seq = rows[i]
        extra = len(work.drafts.get(i, ()))
        if not extra:
            fed.append(len(draw_seqs))
            draw_slots.append(batch.slots[seq.seq_id])
        draw_seqs += [seq] * (1 + extra)
        for fork in forks:  # a copy of the sequence after this pass, with its own draw
            child = dataclasses.replace(seq, seq_id=fork.seq_id, index=fork.index, stopped=False, matcher=None)
            child.token_ids, child.block_table = list(seq.token_ids), list(seq.block_table)
            adopt(child)
            fed.append(len(draw_seqs))
            draw_seqs.append(child)
            draw_slots.append(batch.fork(seq.seq_id, fork.seq_id))
    if fed:
        device = batch.device
        ids = samples.token_ids if len(fed) == len(draw_seqs) else samples.token_ids[to_device(fed, torch.int64, device)]
        batch.feed_back(to_device(draw_slots, torch.int64, device), ids)
    return draw_seqs
