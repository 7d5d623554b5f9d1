"""Resharding from the FSDP2 training layout into vLLM's tensor-parallel layout."""
