"""HiSparse Decode Server: a decode service for DeepSeek Sparse Attention (DSA) models.

Each request keeps its full KV cache in pinned host memory and only a fixed-size buffer on the device;
the attention backend swaps in the top-k rows the lightning indexer selects every step.
"""

__version__ = "0.1.0"
