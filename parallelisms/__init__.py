"""Parallelisms applied to the model before training: the mesh, FSDP/HSDP."""
