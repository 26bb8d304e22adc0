"""The scheduler stage: continuous batching over a paged KV cache.

engine_core.py (the step loop, once: pacing, plans, results), scheduler.py (what runs each step)
with step_builder.py (filling its token budget), windows.py (multi-step), speculation.py (draft
rows), prompt_outputs.py (prompt logprobs, embeddings), forks.py (parallel samples) and
kv_tiers.py (the KV tiers' books: kv_host.py the host slots, kv_disk.py the disk tier, kv_holds.py
prefixes held on the device while read from disk), sequence.py
(per-sequence state) and block_manager.py (KV blocks and each sequence's block table) are pure
Python, free of torch and zmq; main.py is the process loop that owns the sockets; load_report.py
paces its EngineLoad to the router (data parallelism).
"""
