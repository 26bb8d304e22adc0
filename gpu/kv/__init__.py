"""The paged KV cache, apart from its layout: the pool's size and whole-block copies
(kv_cache.py) and the fp8 cache's codes and per-layer scales (kv_fp8.py). Each attention backend
(gpu/backends) allocates the cache in its own layout and writes and reads it.
"""
