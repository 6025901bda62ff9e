"""Tensor parallelism over torch.distributed: the communication group, the sharded layers, and the transform
that shards a built model. The processes that run the ranks belong to the engine (engine/executor/)."""
