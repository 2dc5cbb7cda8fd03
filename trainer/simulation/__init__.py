"""Simulate a whole job on fake tensors before a GPU is rented (``--simulate``; see ``simulate.py``)."""
