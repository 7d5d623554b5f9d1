"""Per-architecture HF <-> vLLM name maps and tiny random-init test models."""
