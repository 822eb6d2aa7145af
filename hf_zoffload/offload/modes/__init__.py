"""The parallel modes: how a bucket's gradients reach this rank's host shard and its new
params get back, for one process, data parallelism, tensor parallelism and FSDP2 parameter
offload."""
