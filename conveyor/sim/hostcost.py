"""Host cost: the engine's CPU work per plan, which the device waits on unless it is overlapped.

    seconds(plan) = per_plan_s + per_row_s * rows of the plan's first pass

One plan's host work is: apply the previous plan's results (pythonize sampled ids, check stops,
stream them out), run the scheduler, build the next inputs (block tables, positions, slot
mappings). It grows with the batch because each of those loops over the rows.

The simulator charges it to the host's clock once per plan, and a plan's passes start when both
the plan and the device are ready (simulator.py); what overlaps is the engine's own pacing,
docs/architecture.md ("Overlap"). A multi-step window pays it once for its K passes: the inner
passes' outputs are processed while the next pass runs (the multi-step RFC), so they add none.
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
