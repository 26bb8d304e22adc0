"""The scheduler stage: continuous batching over a paged KV cache.

sequence.py (per-sequence state), block_manager.py (KV blocks and each sequence's block table),
scheduler.py (what runs each step) are pure Python, free of torch and zmq; main.py is the process
loop that owns the sockets; load_report.py paces its EngineLoad to the router (data parallelism).
"""
