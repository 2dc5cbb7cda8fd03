"""meshtrain: a PyTorch-native distributed LLM trainer."""
