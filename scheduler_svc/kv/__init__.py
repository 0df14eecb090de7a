"""The paged KV cache as the scheduler keeps it: the block pool with its reference counts and
eviction, the prefix cache's chained block hashes, the `KVCacheManager` that hands blocks to sequences
(copy-on-write, forks, swap-out and swap-in), and the queue of sequences swapped out to host memory.
"""
