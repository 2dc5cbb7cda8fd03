"""Simulate a whole job on fake tensors before a GPU is rented (``--simulate``; the mode itself is ``trainer/entry/simulate.py``)."""
