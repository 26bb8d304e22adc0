"""Parallel samples (SamplingParams.n > 1): a request's sequence forks its siblings when its
prompt's draw is planned (StepBuilder.commit), each running beside it from then on and sharing
its blocks until copy-on-write parts them (block_manager.py). Pure Python: no torch, no zmq."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from conveyor.stages.scheduler.scheduler import Scheduler
    from conveyor.stages.scheduler.sequence import Sequence


def fork_siblings(sched: Scheduler, seq: Sequence) -> list[Sequence]:
    """`seq`'s pending siblings, now running: each a copy of it (new id, its own index) holding
    its blocks and its adapter's slot; the worker copies the parent's table."""
    children = []
    for index in range(1, seq.num_pending_forks + 1):
        child = seq.fork(sched.new_seq_id(), index)
        if child.lora_slot >= 0 and sched.adapters is not None and seq.params.adapter is not None:
            sched.adapters.pin(seq.params.adapter)  # the child runs on its parent's slot
        sched.blocks.fork(seq, child)
        child.num_blocks_sent = len(child.block_ids)
        sched.by_request[seq.request_id].append(child)
        sched.running.append(child)
        children.append(child)
    seq.num_pending_forks = 0
    return children
