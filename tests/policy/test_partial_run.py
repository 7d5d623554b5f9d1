"""Partial rollouts in whole colocated runs (`async_rollout.partial`): 2
ranks, 2 engine replicas (TP 1), a few long sequences parked at the
token budget and finished the next step; the checkpoint holds the parked pool
and a resume repeats the uninterrupted run."""

from __future__ import annotations

import json

import pytest

from tests.policy.runs import rows, stable, train

# 60 of the tiny model's 1000 ids end a completion: lengths ~ geometric, mean ~16, cap 24.
PARTIAL = ("--rollout.tensor_parallel_size=1", "--algorithm.behaviour_logp=rollout",
           "--rollout.max_tokens=24", "--async_rollout.max_staleness=1",
           "--rollout.stop_token_ids=" + ",".join(str(i) for i in range(200, 260)),
           "--async_rollout.partial=true")


def _no_partial(row: dict) -> dict:
    """A row without what only a run with partial rollouts reports (k = 1's share at
    staleness 1 is a key a k = 0 run does not have; per-token versions give the
    token staleness, which must then equal the sequences')."""
    out = {k: v for k, v in stable(row).items() if not k.startswith(("partial/", "staleness/"))}
    if out.pop("newer_weights_token_frac", 0.0) != 0.0:
        raise AssertionError(f"tokens newer than their sequence in a roomy run: {row}")
    token_mean = out.pop("staleness_token_mean", out.get("staleness_mean"))
    if token_mean != out.get("staleness_mean"):
        raise AssertionError(f"token staleness {token_mean} != sequence staleness: {row}")
    return out


@pytest.mark.vllm
@pytest.mark.slow
def test_partial_rollouts_park_continue_and_resume(model_dir, reward_file, tmp_path) -> None:
    out, roomy = tmp_path / "partial", tmp_path / "roomy"
    train(model_dir, reward_file, out, 2, *PARTIAL, "--async_rollout.step_token_budget=120")
    # The budget acts: a budget no step reaches parks nothing (every step waits for all).
    train(model_dir, reward_file, roomy, 2, *PARTIAL, "--async_rollout.step_token_budget=100000")
    steps = [r for r in rows(out) if "staleness_max" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert steps[0]["partial/parked_groups"] >= 1  # step 1 stopped at its budget
    assert sum(r["partial/continued_samples"] for r in steps[1:]) >= 1
    assert all(r["staleness_max"] <= 1 for r in steps)  # never past max_staleness
    assert any(r["staleness/1"] > 0 for r in steps[1:])  # parked prefixes trained a step later
    assert all(r["train_samples"] <= 16 for r in steps)
    assert all(r["partial/parked_groups"] == 0 for r in rows(roomy) if "staleness_max" in r)
    assert all(r["staleness_max"] == 0 for r in rows(roomy) if "staleness_max" in r)
    # Parking nothing, the engine loop samples what LLM.generate samples (same seeds, same
    # batch): the roomy run equals the synchronous run metric for metric.
    sync = tmp_path / "sync"
    train(model_dir, reward_file, sync, 2, *[a for a in PARTIAL if "partial" not in a
                                              and "max_staleness" not in a])
    assert [_no_partial(r) for r in rows(roomy)] == [_no_partial(r) for r in rows(sync)]
    ckpt = json.loads(sorted((out / "checkpoints").glob("*/meta.json"))[-1].read_text())
    pool = ckpt["extra"]["rollout"]["pool"]
    assert len(pool) == steps[1]["partial/parked_groups"]
    assert any(s["tokens"] and not s["finished"] for g in pool for s in g["samples"])
    before = rows(out)
    train(model_dir, reward_file, out, 2, *PARTIAL, "--async_rollout.step_token_budget=120", "--resume")
    resumed = rows(out)
    assert [r["step"] for r in resumed] == [r["step"] for r in before]
    assert stable(resumed[-1]) == stable(before[-1])
