"""Checkpoints: the manager the training loop calls (``manager``), the training-checkpoint folder
it writes and the converters read (``folders``), and Hugging Face model folders (``hf_folders``)."""
