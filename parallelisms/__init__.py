"""Parallelisms applied to the model before training: the mesh, tensor, context and data parallelism."""
