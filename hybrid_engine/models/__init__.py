"""Tiny random-init HF models (Qwen2, Llama, Qwen3) and their offline byte-level tokenizer."""
