"""A slow host, for tests/daemon/test_observability.py, which puts this directory on PYTHONPATH of the
daemon it starts: Python imports this module at start-up in every process of that daemon, and in
the scheduler's only it makes each plan take PLAN_DELAY_S longer to build. The worker then waits
on its host before every step, which the GPU-bubble metrics must show."""

import sys
import time

PLAN_DELAY_S = 0.1


def slow_down_planning() -> None:
    from conveyor.stages.scheduler import engine_core

    build = engine_core.step_plan

    def step_plan(step):
        plan = build(step)
        time.sleep(PLAN_DELAY_S)
        return plan

    engine_core.step_plan = step_plan


# The launcher starts the scheduler as `python -m conveyor.stages scheduler 0 CONFIG_JSON ...`;
# while site runs, sys.argv holds "-m" and the module's own arguments.
if sys.argv[1:2] == ["scheduler"]:
    slow_down_planning()
