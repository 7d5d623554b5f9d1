"""Whole `hybrid-engine train` runs under torchrun for the policy tests, and how
their metrics compare (test helper)."""

from __future__ import annotations

import json
from pathlib import Path

from hybrid_engine.testing import run_torchrun

# Keys that differ between placements or runs by nature: times, memory, the sync's own
# report, and the mismatch split (the colocated policy's drift scorer, when samples are stale).
VARYING = ("_s", "mem_", "sync_", "tok_s", "mismatch_drift", "mismatch_numerics",
           "mismatch_split")


def train(model: Path, reward: Path, out: Path, nproc: int, *extra: str):  # noqa: ANN201
    """3 steps of tiny_grpo_debug (8 new tokens, eval at steps 0 and 3, checkpoint at 2),
    the engine released every step with GPU sleep emulated, plus extra."""
    return run_torchrun(
        ["-m", "hybrid_engine.cli", "train", "--recipe=tiny_grpo_debug", "--no-progress",
         f"--model.path={model}", f"--output_dir={out}", "--eval.num_prompts=4",
         "--rollout.max_tokens=8", "--train.num_steps=3", "--eval.every=3",
         "--eval.at_start=true",
         "--checkpoint_every=2", f"--env.reward_fn={reward}:reward",
         # Colocated twins release every step: emulate GPU sleep (weights lost) there too.
         "--memory.emulate_gpu_sleep=true", "--memory.release=true", *extra],
        nproc, timeout=400)


def rows(out: Path) -> list[dict]:
    return [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]


def stable(row: dict) -> dict:
    return {k: v for k, v in row.items() if not any(p in k for p in VARYING)}
