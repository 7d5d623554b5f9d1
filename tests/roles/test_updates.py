"""PPO updates per rollout (`roles.updates`): the shuffled mini-batch plan, metric
combination, and 2 epochs x 2 mini-batches on 2 real FSDP2 ranks against a plain
1-process loop written here (old log-probs once, then four AdamW steps).

Tolerances (fp32) as in tests/roles/test_trainer.py: other rank counts and
micro-batch splits sum in another order, and AdamW amplifies rounding on near-zero
gradients up to lr / eps, so the runs train at lr 2e-5 and the weights must agree
to 1e-6 relative to each tensor's largest element (and 1e-6 abs).
"""

from __future__ import annotations

import pytest
import torch

from hybrid_engine.roles.updates import combine_updates, num_updates, update_plan
from hybrid_engine.testing import run_ranks
from tests.roles.test_trainer import CHUNK, LR, SPECS, full_weights, make_trajs, plain_logprobs

NUM = 8  # trajectories of the fixed rollout


# --------------------------------------------------------------------------
# The plan and the metrics (pure)
# --------------------------------------------------------------------------


def test_one_update_is_the_identity_and_unshuffled():
    assert update_plan(5, mini_batches=1, epochs=1, seed=3) == [[0, 1, 2, 3, 4]]


@pytest.mark.parametrize(("num", "mini", "epochs"), [(8, 2, 2), (7, 3, 1), (5, 1, 3), (3, 5, 2)])
def test_each_epoch_is_a_permutation_cut_into_nearly_equal_mini_batches(num, mini, epochs):
    plan = update_plan(num, mini_batches=mini, epochs=epochs, seed=11)
    m = min(mini, num)  # never an empty mini-batch
    assert len(plan) == m * epochs
    for e in range(epochs):
        parts = plan[e * m:(e + 1) * m]
        assert sorted(i for p in parts for i in p) == list(range(num))
        assert max(map(len, parts)) - min(map(len, parts)) <= 1
    assert plan == update_plan(num, mini_batches=mini, epochs=epochs, seed=11)  # every rank
    if num * epochs > 3:
        assert plan != update_plan(num, mini_batches=mini, epochs=epochs, seed=12)


def test_plan_rejects_bad_counts():
    with pytest.raises(ValueError, match="need num, mini_batches, epochs >= 1"):
        update_plan(0, mini_batches=1, epochs=1, seed=0)
    with pytest.raises(ValueError):
        update_plan(4, mini_batches=0, epochs=1, seed=0)


def test_combine_updates_sums_counts_takes_extremes_last_lr_and_means():
    a = dict(loss=1.0, tokens=10.0, skipped=0.0, lr=1e-3, ratio_max=1.2, ratio_min=0.9,
             clip_frac=0.1, num_micro_batches=2.0, train_step_s=1.0)
    b = dict(loss=3.0, tokens=6.0, skipped=1.0, lr=2e-3, ratio_max=1.1, ratio_min=0.7,
             clip_frac=0.3, num_micro_batches=1.0, train_step_s=0.5)
    out = combine_updates([a, b])
    assert out == pytest.approx(dict(loss=2.0, tokens=16.0, skipped=1.0, lr=2e-3, ratio_max=1.2,
                                     ratio_min=0.7, clip_frac=0.2, num_micro_batches=3.0,
                                     train_step_s=1.5, optimizer_steps=1.0))
    assert combine_updates([]) == {}


@pytest.mark.parametrize("behaviour, first_only", [("rollout", True), ("trainer", False)])
def test_without_old_logprobs_only_the_first_update_measures_the_mismatch(
        behaviour, first_only, monkeypatch):
    """behaviour_logp=rollout with 4 updates: no old log-probs, so updates 2-4
    measure weights this step already moved; only the first's mismatch counts
    (the trainer's old log-probs serve every update: all count)."""
    from types import SimpleNamespace

    from hybrid_engine.config import apply_overrides
    from hybrid_engine.config.recipes import get_recipe
    from hybrid_engine.roles import updates

    monkeypatch.setattr(updates, "compute_old_logp", lambda *a: None)
    cfg = apply_overrides(get_recipe("tiny_grpo_debug"), {
        "train.mini_batches_per_rollout": 2, "train.ppo_epochs": 2,
        "algorithm.behaviour_logp": behaviour})
    calls = []

    def step(mini, last):  # noqa: ANN001, ANN202
        calls.append(len(mini))
        n = float(len(calls))
        return {"loss": n, "mismatch_abs_mean": n, "mismatch_numerics_abs_mean": n,
                "mismatch_tokens": 10.0, "mismatch_split_tokens": 10.0}

    m = updates.policy_updates(SimpleNamespace(step=0), make_trajs(NUM, 50), cfg, 0, step)
    assert len(calls) == 4 and m["loss"] == 2.5
    want = 1.0 if first_only else 2.5
    assert m["mismatch_abs_mean"] == m["mismatch_numerics_abs_mean"] == want


@pytest.mark.parametrize("overrides, expected", [
    ({}, 1), ({"rollout.mismatch_sample": 3}, 3), ({"rollout.mismatch_sample": 0}, 0),
    ({"algorithm.behaviour_logp": "rollout"}, None), ({"algorithm.tis_cap": 2.0}, None),
    ({"algorithm.rollout_correction": "seq_mask"}, None),
    ({"algorithm.kl_coef": 0.1, "algorithm.kl_in_reward": True}, None),
    ({"algorithm.kl_coef": 0.1}, 1),  # the KL loss term reads the reference, not vLLM
    ({"async_rollout.max_staleness": 1, "algorithm.behaviour_logp": "rollout"}, None),
])
def test_vllm_returns_logprobs_for_all_completions_only_when_something_reads_them(
        overrides, expected):
    from hybrid_engine.config import apply_overrides
    from hybrid_engine.config.recipes import get_recipe
    from hybrid_engine.policy.training import logprob_samples

    assert logprob_samples(apply_overrides(get_recipe("tiny_grpo_debug"), overrides)) == expected


def test_training_on_trajectories_without_advantages_is_an_error():
    """The embedding API: trajectories straight from generate() have none; training
    them would move nothing but the LR schedule."""
    from hybrid_engine.config.recipes import get_recipe
    from hybrid_engine.policy.training import policy_train

    trajs = make_trajs(NUM, 50)
    trajs[3].advantages = None
    with pytest.raises(ValueError, match="1 of 8 trajectories have no advantages"):
        policy_train(None, get_recipe("tiny_grpo_debug"), trajs, 0, None, None)


def test_num_updates_caps_mini_batches_at_the_trajectory_count():
    from hybrid_engine.config import TrainConfig

    cfg = TrainConfig(ppo_epochs=3, mini_batches_per_rollout=4)
    assert num_updates(10, cfg) == 12 and num_updates(2, cfg) == 6


# --------------------------------------------------------------------------
# Real ranks against a plain loop
# --------------------------------------------------------------------------


def _config(path: str, **kw):
    from hybrid_engine.config import apply_overrides
    from hybrid_engine.config.recipes import get_recipe

    base = {"model.path": path, "train.lr": LR, "train.grad_clip": 1.0,
            "train.micro_batch_size": 2, "algorithm.clip_low": 0.2,
            "algorithm.clip_high": 0.28, "model.compute_dtype": "float32",
            "model.master_dtype": "float32", "train.lr_schedule": "cosine",
            "train.num_steps": 4}
    return apply_overrides(get_recipe("tiny_grpo_debug"), {**base, **kw})


def _policy_run(path: str, vocab: int, **kw) -> dict:
    """One RL step's updates through `actor.policy_train` on a fresh trainer; counts
    the no-grad log-prob passes (old log-probs) the trainer is asked for."""
    from hybrid_engine.policy.training import policy_train
    from hybrid_engine.roles.trainer import Trainer

    cfg = _config(path, **kw)
    trainer = Trainer(path, cfg.train, cfg.model, logits_chunk_tokens=CHUNK)
    calls = []
    real = trainer.compute_logprobs
    trainer.compute_logprobs = lambda batch: calls.append(1) or real(batch)
    trajs = make_trajs(NUM, vocab)
    m = policy_train(trainer, cfg, trajs, 0, None, None)
    return dict(metrics=m, forwards=len(calls), weights=full_weights(trainer.module),
                lr_steps=trainer.scheduler.last_epoch, step=trainer.step,
                old_set=all(t.old_logp is not None for t in trajs))


def plain_ppo(path: str, vocab: int, epochs: int, mini: int, seed: int) -> dict:
    """The reference: a transformers model in one process; old log-probs of all
    trajectories first, then per epoch a randperm (one generator) cut into mini
    contiguous mini-batches, each one AdamW step on its token-mean PPO loss."""
    from transformers import AutoModelForCausalLM

    from hybrid_engine.algorithms import LossInputs, policy_loss_fn
    from hybrid_engine.config import AlgorithmConfig
    from hybrid_engine.trajectory import collate_trajectories

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    params = list(model.parameters())
    optimizer = torch.optim.AdamW([{"params": [p for p in params if p.ndim >= 2]},
                                   {"params": [p for p in params if p.ndim < 2]}], lr=LR,
                                  weight_decay=0.0)
    trajs = make_trajs(NUM, vocab)
    whole = collate_trajectories(trajs, pad_id=0)
    with torch.no_grad():
        old = whole.per_trajectory(plain_logprobs(model, whole))
    for t, o in zip(trajs, old):
        t.old_logp = o
    loss_fn = policy_loss_fn(AlgorithmConfig(clip_low=0.2, clip_high=0.28))
    g = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        perm = torch.randperm(NUM, generator=g).tolist()
        for j in range(mini):
            batch = collate_trajectories([trajs[i] for i in perm[NUM * j // mini:NUM * (j + 1) // mini]],
                                         pad_id=0)
            loss, _ = loss_fn(LossInputs(logp_BT=plain_logprobs(model, batch),
                                         advantages_BT=batch.advantages_BT,
                                         mask_BT=batch.loss_mask_BT,
                                         old_logp_BT=batch.old_logp_BT), None)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            optimizer.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _two_rank_updates(root: str) -> dict | None:
    import torch.distributed as dist

    from hybrid_engine.models.tiny import TinyModelSpec, write_tiny_model

    spec = TinyModelSpec(**SPECS["qwen2"])
    path = f"{root}/qwen2"
    if dist.get_rank() == 0:
        write_tiny_model(path, spec)
    dist.barrier()
    vocab = spec.vocab_size
    runs = {
        "ppo": _policy_run(path, vocab, **{"train.ppo_epochs": 2,
                                           "train.mini_batches_per_rollout": 2}),
        "single": _policy_run(path, vocab),
        "rollout": _policy_run(path, vocab, **{"train.mini_batches_per_rollout": 2,
                                               "algorithm.behaviour_logp": "rollout"}),
    }
    if dist.get_rank():
        return None
    plain = plain_ppo(path, vocab, 2, 2, seed=0)  # cfg.seed 0, trainer.step 0
    out = {k: {**v, "weights": {n: w.numpy() for n, w in v["weights"].items()}}
           for k, v in runs.items()}
    out["plain"] = {n: w.numpy() for n, w in plain.items()}
    return out


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict:
    return run_ranks(_two_rank_updates, 2, str(tmp_path_factory.mktemp("updates")),
                     timeout=300)[0]


def test_two_epochs_two_mini_batches_on_two_ranks_match_a_plain_loop(two_ranks):
    run, plain = two_ranks["ppo"], two_ranks["plain"]
    assert run["weights"].keys() == plain.keys()
    for name, w in run["weights"].items():
        ref = torch.from_numpy(plain[name])
        diff = float((torch.from_numpy(w) - ref).abs().max())
        assert diff <= 1e-6 * max(float(ref.abs().max()), 1.0), (name, diff)
    init = two_ranks["single"]["weights"]  # moved: the comparison is not vacuous
    assert max(float(abs(run["weights"][n] - init[n]).max()) for n in init) > 1e-5


def test_several_updates_compute_old_logprobs_once_and_the_ratio_leaves_one(two_ranks):
    run = two_ranks["ppo"]
    m = run["metrics"]
    assert run["forwards"] == 1 and run["old_set"]
    assert m["optimizer_steps"] == 4 and run["step"] == 4
    assert m["ratio_max"] > 1.0 or m["ratio_min"] < 1.0  # updates 2-4 see moved weights
    assert m["ppo_kl"] != 0.0
    # The schedule counts RL steps: one LR step for the four optimizer steps.
    assert run["lr_steps"] == 1


def test_one_update_pays_no_extra_forward_and_its_ratio_is_one(two_ranks):
    run = two_ranks["single"]
    m = run["metrics"]
    assert run["forwards"] == 0 and not run["old_set"]
    assert m["optimizer_steps"] == 1
    assert m["ratio_min"] == m["ratio_max"] == 1.0 and m["clip_frac"] == 0.0


def test_behaviour_logp_rollout_takes_the_engines_logprobs_without_a_forward(two_ranks):
    run = two_ranks["rollout"]
    m = run["metrics"]
    assert run["forwards"] == 0 and not run["old_set"]
    # make_trajs' rollout log-probs are in [-1, 0], the tiny model's near -log(1001):
    # the ratio to them is far below 1 from the first update on, and the low clip binds.
    assert m["ratio_max"] < 0.8 and m["clip_frac_low"] > 0
