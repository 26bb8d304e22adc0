"""The paged KV cache, apart from its layout: the pool's size and whole-block copies
(kv_cache.py), the fp8 cache's codes and per-layer scales (kv_fp8.py), and the tiers beyond the
device: host-memory slots and the copies to and from them (host_tier.py), and blocks as files that
survive restarts (disk_tier.py; its format disk_format.py, its directory disk_dir.py, its files and size cap disk_files.py, its reads
on a hit disk_reads.py, the blocks other daemons sharing the directory write disk_news.py). Each
attention backend (gpu/backends) allocates the cache in its own layout and writes and reads it.
"""
