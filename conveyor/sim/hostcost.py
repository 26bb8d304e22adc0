"""Host cost: the engine's CPU work per plan, which the device waits on unless it is overlapped.

    seconds(plan) = per_plan_s + per_row_s * rows of the plan's first pass

One plan's host work is: apply the previous plan's results (pythonize sampled ids, check stops,
stream them out), run the scheduler, build the next inputs (block tables, positions, slot
mappings). It grows with the batch because each of those loops over the rows.

How the simulator spends it (simulator.py):
  synchronous     host, then device, one after the other: a plan's wall time is host + device
  asynchronous    the host plans step n+1 while step n computes: wall time max(host, device),
                  except the first plan after an idle spell, which has nothing to overlap with
  multi-step (K)  a plan whose rows all decode runs K passes on the device for one host cost;
                  the inner passes' outputs are copied back on a side stream and processed while
                  the next pass runs (the multi-step RFC), so they add no host time

The zero HostCost is the default: the cpu-tiny and a100-* presets fold host work into their
per-pass intercept, so they keep their figures.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class HostCost:
    per_plan_s: float = 0.0  # schedule + prepare + process outputs: the fixed part
    per_row_s: float = 0.0  # the same work per sequence in the plan
    name: str = "none"

    def seconds(self, num_rows: int) -> float:
        return self.per_plan_s + self.per_row_s * num_rows if num_rows else 0.0
