"""Group colocation (`placement=grouped`) on real ranks: the actor, its rollout
and its reference take turns on ranks 0-1, the critic and the reward model sit
on rank 2, and the run equals the all-colocated one on the same 3 ranks.

Reference: PPO (GAE critic, KL to the reference, a reward model's score in the
reward) colocated on 3 ranks with the same seeds and data. The samples and the
function reward's term are the same exactly
(a completion's seed does not depend on the replica that draws it); the reward
model's scores, the values, advantages, losses and gradient norms to fp32
round-off (FSDP2 over 2 ranks and over 3 reduce in
another order)."""

from __future__ import annotations

import pytest

from tests.policy.runs import assert_rows_close
from tests.policy.runs import rows as _rows
from tests.policy.runs import stable as _stable
from tests.policy.runs import train as _train

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PPO = ("--algorithm.advantage=gae", "--algorithm.kl_coef=0.05", "--train.sharding=full",
       "--rollout.tensor_parallel_size=1")
GROUPED = ("--placement=grouped",
           "--placement_map=actor,rollout,reference:0-1;critic,reward_model:2")
# Equal exactly: what the samples decide (the reward model's score and the
# advantages, which use the critic's values: fp32 round-off, with the losses).
EXACT = ("reward/reward", "response_len_mean", "generated_tokens", "train_samples")


def test_grouped_equals_colocated_on_the_same_ranks_and_resumes(model_dir, reward_file,
                                                                tmp_path) -> None:
    """3 steps, a checkpoint at step 2 (both groups write it), the final model;
    then a resume from step 2 repeats step 3 exactly."""
    import json

    from hybrid_engine.checkpoint import step_checkpoint_path

    from hybrid_engine.envs.reward_model import write_tiny_reward_model

    rm = write_tiny_reward_model(tmp_path / "rm")
    ppo = (*PPO, f"--env.reward_model_path={rm}", "--env.reward_fn=",
           f"--env.rewards={reward_file}:reward:1.0,reward_model:0.5")
    grouped, colocated = tmp_path / "grouped", tmp_path / "colocated"
    proc = _train(model_dir, reward_file, grouped, 3, *ppo, *GROUPED)
    assert ("grouped policy ready" in proc.stdout and "actor+rollout+reference on ranks 0-1; "
            "critic+reward_model on ranks 2" in proc.stdout), proc.stdout[-3000:]
    _train(model_dir, reward_file, colocated, 3, *ppo)
    rows_g, rows_c = _rows(grouped), _rows(colocated)
    straight = [dict(r) for r in rows_g]
    assert [r["step"] for r in rows_g] == [0, 1, 2, 3]
    assert all(r["skipped_degenerate"] == 0.0 for r in rows_g[1:])  # every step trained
    assert all("kl" in r and "critic/vf_loss" in r and r["reward/reward_model"] != 0
               for r in rows_g[1:])  # the three roles ran
    for g, c in zip(rows_g[1:], rows_c[1:], strict=True):
        assert {k: g[k] for k in EXACT} == {k: c[k] for k in EXACT}
    # What moved between the groups: the trajectories to rank 2, the values back
    # (4 bytes per response token), and the reward model's scores, computed on
    # rank 2 beside the reference (4 bytes per sample).
    moved = [{k: r.pop(k) for k in ("placement/trajectory_bytes", "placement/critic_bytes",
                                    "placement/reward_model_bytes")} for r in rows_g[1:]]
    tokens = [r["generated_tokens"] for r in rows_g[1:]]
    assert [m["placement/critic_bytes"] for m in moved] == [4 * n for n in tokens]
    assert [m["placement/reward_model_bytes"] for m in moved] == [
        4 * r["train_samples"] for r in rows_g[1:]]
    assert all(r["placement/reward_model_score_s"] > 0 for r in rows_g[1:])
    assert all(m["placement/trajectory_bytes"] > 4 * n for m, n in zip(moved, tokens))
    assert_rows_close(rows_g, rows_c)  # the evaluation of the trained weights included
    assert (grouped / "final" / "COMPLETE").is_file()
    # The checkpoint holds the critic (written by rank 2) beside the policy.
    ckpt = step_checkpoint_path(grouped / "checkpoints", 2)
    assert sorted(f.name for f in (ckpt / "dcp").glob("*.distcp")) == [
        "__0_0.distcp", "__1_0.distcp", "__2_0.distcp"]
    meta = json.loads((ckpt / "meta.json").read_text())
    assert meta["critic"]["step"] == 2 and meta["step"] == 2 and meta["world_size"] == 3
    _train(model_dir, reward_file, grouped, 3, *ppo, *GROUPED, "--resume")
    resumed = _rows(grouped)
    assert [r["step"] for r in resumed] == [0, 1, 2, 3]
    assert _stable(resumed[3]) == _stable(straight[3])
