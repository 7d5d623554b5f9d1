"""Model families (`spec.py`, one file per family in `families/`), tiny random-init HF
models and their offline byte-level tokenizer, chat templates, and MoE checkpoints."""
