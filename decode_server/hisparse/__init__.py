"""HiSparse: each request's full KV in a pinned host pool, a fixed device buffer (D LRU slots + R recent-token
slots) on the GPU, the lightning indexer's top-k rows swapped in every step. See docs/engine.md.

`HiSparseCoordinator` (coordinator.py) owns the pools and is the engine's `KVManager` in HiSparse mode;
`HiSparseBackend` (backend.py) is the attention backend the model calls.
"""
