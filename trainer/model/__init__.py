"""The model: Llama 3 (``llama3``) and its Hugging Face adapter (``hf_llama3``), which describes
the same weights in ``LlamaForCausalLM``'s names, layout and ``config.json``."""
