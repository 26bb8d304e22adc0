"""The worker's step: a StepPlan run on one device (one tensor-parallel rank).

runner.py (`ModelRunner`: launch / collect / execute) drives it; plan_checks.py refuses a bad plan
before any state changes; persistent_batch.py keeps each sequence's device-resident row and
step_inputs.py builds a pass's inputs from it; passes.py holds the host's per-sequence state, a
plan's window of passes and a launched pass until its results land; cuda_graphs.py captures and
replays decode steps; pooling.py turns a pooling sequence's hidden states into its vector.
platform.py is what the runner needs of the hardware (real or emulated), pass_clock.py the
device's busy and idle time per pass, profile_steps.py the KV sizing profile, host_memory.py the
worker process's malloc settings. The models, backends, sampling and features (lora/, spec/,
structured/) are the step's callees, in their own packages.
"""
