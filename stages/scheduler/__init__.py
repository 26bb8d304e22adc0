"""The scheduler stage: continuous batching over a paged KV cache.

sequence.py (per-sequence state), block_pool.py (KV blocks), scheduler.py (what runs each step)
are pure Python, free of torch and zmq; main.py is the process loop that owns the sockets.
"""
