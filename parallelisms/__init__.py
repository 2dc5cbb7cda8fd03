"""Parallelisms applied to the model before training: the mesh, tensor parallelism, FSDP/HSDP."""
