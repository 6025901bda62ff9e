"""Tensor parallelism over torch.distributed: the communication group, the sharded layers, the transform that
shards a model, and the multi-process executor that runs one rank per worker process."""
