"""The worker's step: a StepPlan run on one device (one tensor-parallel rank).

The core: runner.py (`ModelRunner`: launch / collect / execute) applies a plan and runs its
passes; plan_checks.py refuses a bad plan before any state changes; persistent_batch.py keeps
each sequence's device-resident row; pass_work.py says what each pass computes and
step_inputs.py builds its inputs; pass_sampler.py draws; advance.py moves the host's counts;
in_flight.py holds launched passes until their ids land and passes.py turns each into a
StepResult; cuda_graphs.py captures and replays decode steps. features/ holds what a step does
beyond running the model (LoRA, speculation, prompt logprobs, pooling, grammars), each a
StepFeature. platform.py is what the runner needs of the hardware (real or emulated),
pass_clock.py the device's busy and idle time per pass, profile_steps.py the KV sizing profile,
host_memory.py the worker process's malloc settings.
"""
