"""Tensor and expert parallelism across the GPUs of one node (issue #16): process-group state, collectives,
and the sharded layers the model is built from. docs/parallelism.md describes the sharding of every weight."""
