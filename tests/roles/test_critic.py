"""The critic on real gloo ranks: sharded init, values layout, a falling value loss,
1 vs 2 ranks giving the same update, and each of its training layouts
(train.critic_sharding) on 4 ranks giving the one-rank update and resuming exactly.

Tolerances (fp32): other rank counts sum the same terms in another order, so the
weights agree to float32 rounding, not bitwise. As in tests/roles/test_trainer.py,
AdamW amplifies gradient noise on near-zero elements up to lr / eps, so the parity
run trains at lr 2e-5 and compares weights to 1e-6 abs, losses to 1e-6 rel.
"""

from __future__ import annotations

import pytest
import torch

from hybrid_engine.testing import run_ranks
from tests.roles.test_trainer import full_weights, make_trajs, max_diff, rank_batch

SPEC = dict(arch="qwen2", vocab_size=1001)
VOCAB = 1001


def _returns(batch) -> torch.Tensor:
    """Targets that depend on the token only (row order and rank split do not matter)."""
    return torch.where(batch.loss_mask_BT, (batch.tokens_BT % 7).float() / 3 - 1.0, 0.0)


def _old_shift(batch) -> torch.Tensor:
    """+-0.5 by token parity: old values far outside the 0.2 clip range of the current
    ones, so the clipped branch is active on some tokens from the first step."""
    return torch.where(batch.loss_mask_BT, (batch.tokens_BT % 2).float() - 0.5, 0.0)


def _critic(path: str, lr: float, **kw):
    from hybrid_engine.config import ModelConfig, TrainConfig
    from hybrid_engine.roles.critic import Critic

    return Critic(path, TrainConfig(lr=lr, grad_clip=1.0, **kw),
                  ModelConfig(compute_dtype="float32"))


def _check_layout(path: str) -> dict:
    """Init (backbone rows equal the policy file, head zero), values shape and masking."""
    import safetensors
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from hybrid_engine.parallel.params import sharded_named_parameters
    from hybrid_engine.reshard.plan import shard_rows

    critic = _critic(path, 1e-3)
    rank, world = dist.get_rank(), dist.get_world_size()
    init_equal, names = True, []
    with safetensors.safe_open(f"{path}/model.safetensors", "pt") as f:
        for name, p in sharded_named_parameters(critic.module):
            names.append(name)
            if name.startswith("value_head."):
                init_equal &= bool((p.to_local() == 0).all())
                continue
            start, end = shard_rows(p.shape[0], world, rank)
            init_equal &= torch.equal(p.to_local(), f.get_tensor(name)[start:end])
    batch = rank_batch(make_trajs(8, VOCAB, seed=3), micro_batch_size=3)
    zero_values = critic.values(batch)
    # One step so the head is non-zero, then check the layout of real values.
    critic.train_step(batch, _returns(batch), zero_values, clip=None)
    values = critic.values(batch)
    mask = batch.loss_mask_BT
    # The same rows in one micro-batch: micro-batching must not change values.
    whole = critic.values(batch.rows(0, batch.num_seqs))
    width = whole.shape[1]
    return dict(
        init_equal=init_equal, names=names, zero=bool((zero_values == 0).all()),
        shape=tuple(values.shape) == tuple(batch.tokens_BT.shape),
        dtype=str(values.dtype), masked_zero=bool((values[~mask] == 0).all()),
        nonzero=bool((values[mask] != 0).all()),
        mb_diff=float((whole - values[:, :width]).abs().max()),
        sharded=all(isinstance(p, DTensor) for p in critic.module.parameters()),
    )


def _train(path: str, steps: int, lr: float, clip: float | None, shift: bool = False,
           mb: int = 2, **layout) -> dict:
    """steps critic updates on a fixed batch; old values from before the first
    (+ `_old_shift` with shift); layout: train.critic_sharding and its group size."""
    critic = _critic(path, lr, micro_batch_size=mb, **layout)
    batch = rank_batch(make_trajs(8, VOCAB, seed=5), micro_batch_size=mb)
    returns, old = _returns(batch), critic.values(batch)
    if shift:
        old = old + _old_shift(batch)
    metrics = [critic.train_step(batch, returns, old, clip=clip, coef=0.5) for _ in range(steps)]
    return dict(metrics=metrics, weights=full_weights(critic.module), critic=critic,
                args=(batch, returns, old))


def _two_rank_checks(root: str) -> dict:
    import torch.distributed as dist

    from hybrid_engine.models.tiny import TinyModelSpec, write_tiny_model

    path = f"{root}/model"
    if dist.get_rank() == 0:
        write_tiny_model(path, TinyModelSpec(**SPEC))
    dist.barrier()
    fit, clipped = (_train(path, 8, 1e-3, clip=None), _train(path, 3, 2e-5, clip=0.2, shift=True))
    return dict(layout=_check_layout(path), **{k: dict(metrics=r["metrics"], weights=r["weights"])
                                               for k, r in (("fit", fit), ("clipped", clipped))})


def _one_rank_parity(path: str) -> dict:
    out = _train(path, 3, 2e-5, clip=0.2, shift=True)
    return dict(metrics=out["metrics"], weights=out["weights"])


LAYOUTS = {"grad_op": {}, "hybrid": {"critic_shard_group_size": 2}, "replicate": {}}


def _layout_facts(critic, batch) -> dict:
    """How the parameters are laid out: DTensor mesh dims (0: plain tensors), and
    whether a decoder layer stays gathered after a forward without backward."""
    from torch.distributed.tensor import DTensor

    p = next(critic.module.parameters())
    critic._forward(batch.rows(0, 1))
    layer = next(critic.module.model.layers[0].parameters())
    critic.values(batch)  # reshards
    return dict(mesh_dims=p.device_mesh.ndim if isinstance(p, DTensor) else 0,
                gathered_after_forward=not isinstance(layer, DTensor))


def _four_rank_layouts(root: str) -> dict:
    """Per layout: 3 updates (2 micro-batches per rank), then a resume: a fresh
    critic loads a checkpoint of step 2 and repeats step 3."""
    from hybrid_engine.checkpoint import load_training_state, save_training_state

    path, out = f"{root}/model", {}
    for name, kw in LAYOUTS.items():
        run = _train(path, 2, 2e-5, clip=0.2, shift=True, mb=1, critic_sharding=name, **kw)
        critic, args = run["critic"], run["args"]
        save_training_state(f"{root}/ckpt-{name}", trainer=None, critic=critic, group=None)
        third = critic.train_step(*args, clip=0.2, coef=0.5)
        fresh = _critic(path, 2e-5, micro_batch_size=1, critic_sharding=name, **kw)
        load_training_state(f"{root}/ckpt-{name}", trainer=None, critic=fresh, group=None)
        again = fresh.train_step(*args, clip=0.2, coef=0.5)
        out[name] = dict(metrics=[*run["metrics"], third], weights=full_weights(critic.module),
                         resumed=again, resumed_weights=full_weights(fresh.module),
                         drift=_drift(fresh, args), **_layout_facts(critic, args[0]))
    return out


def _drift(critic, args) -> str | None:
    """One ulp changed on the last rank, then a step with train.replica_check_every=1:
    the ReplicaDrift message (None: no drift found)."""
    import dataclasses

    import torch.distributed as dist

    from hybrid_engine.parallel.replicas import ReplicaDrift

    critic.train_cfg = dataclasses.replace(critic.train_cfg, replica_check_every=1)
    if dist.get_rank() == dist.get_world_size() - 1:
        with torch.no_grad():
            w = next(critic.module.parameters())
            w = (w.to_local() if hasattr(w, "to_local") else w).view(-1)
            w[0] = torch.nextafter(w[0], w[0] + 1)
    try:
        critic.train_step(*args, clip=0.2, coef=0.5)
    except ReplicaDrift as e:
        return str(e)
    return None


@pytest.fixture(scope="module")
def model_root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("critic"))


@pytest.fixture(scope="module")
def two_ranks(model_root) -> list[dict]:
    return run_ranks(_two_rank_checks, 2, model_root, timeout=240)


# --------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------


def test_sharded_init_from_policy_folder(two_ranks):
    for r in two_ranks:
        lay = r["layout"]
        assert lay["init_equal"] and lay["sharded"]
        assert "value_head.weight" in lay["names"] and "value_head.bias" in lay["names"]
        assert not any(n.startswith("lm_head") for n in lay["names"])
        assert lay["zero"]  # zero head: first values are exactly 0


def test_values_shape_and_masking(two_ranks):
    for r in two_ranks:
        lay = r["layout"]
        assert lay["shape"] and lay["dtype"] == "torch.float32"
        assert lay["masked_zero"] and lay["nonzero"]
        assert lay["mb_diff"] < 1e-6


def test_value_loss_falls_on_fixed_batch(two_ranks):
    losses = [m["vf_loss"] for m in two_ranks[0]["fit"]["metrics"]]
    assert losses[-1] < 0.5 * losses[0], losses
    assert all(m["skipped"] == 0.0 for m in two_ranks[0]["fit"]["metrics"])
    # Metrics are global: every rank reports the same numbers.
    assert two_ranks[0]["fit"]["metrics"] == two_ranks[1]["fit"]["metrics"]


def test_first_step_loss_is_global_token_mean_of_clipped_value_loss(two_ranks):
    """The zero head makes the first values 0, so the first step's loss is known by
    hand: coef * token-mean over BOTH ranks' rows of value_loss(0, old, R, clip)."""
    from hybrid_engine.algorithms.value_loss import value_loss
    from hybrid_engine.trajectory import collate_trajectories

    batch = collate_trajectories(make_trajs(8, VOCAB, seed=5), pad_id=0)
    mask, returns, old = batch.loss_mask_BT, _returns(batch), _old_shift(batch)
    loss_BT, _ = value_loss(torch.zeros_like(returns), old, returns, mask, 0.2)
    expected = 0.5 * float(loss_BT.sum() / mask.sum())
    clipped = 0.5 * (torch.where(mask, old + (-old).clamp(-0.2, 0.2) - returns, 0.0) ** 2)
    expected_frac = float((clipped > 0.5 * returns**2)[mask].float().mean())
    first = two_ranks[0]["clipped"]["metrics"][0]
    assert first["num_loss_tokens"] == mask.sum()
    assert first["vf_loss"] == pytest.approx(expected, rel=1e-6)
    assert 0.0 < first["vf_clip_frac"] < 1.0
    assert first["vf_clip_frac"] == pytest.approx(expected_frac, rel=1e-6)


def test_one_and_two_ranks_give_the_same_update(two_ranks, model_root):
    one = run_ranks(_one_rank_parity, 1, f"{model_root}/model", timeout=120)[0]
    two = two_ranks[0]["clipped"]
    assert max_diff(one["weights"], two["weights"]) < 1e-6
    for a, b in zip(one["metrics"], two["metrics"]):
        assert a["vf_loss"] == pytest.approx(b["vf_loss"], rel=1e-6)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
        assert a["vf_clip_frac"] == b["vf_clip_frac"]


def test_each_critic_layout_gives_the_one_rank_update_and_resumes_exactly(two_ranks, model_root):
    """train.critic_sharding on 4 ranks: each layout is the one asked for (replicate:
    plain tensors; hybrid: a 2-D mesh; grad_op: layers kept gathered after a
    forward), trains as one rank does, a checkpoint of step 2 repeats step 3,
    and a replica changed by one ulp stops the next step."""
    one = run_ranks(_one_rank_parity, 1, f"{model_root}/model", timeout=120)[0]
    four = run_ranks(_four_rank_layouts, 4, model_root, timeout=400)
    expect = {"grad_op": (1, True), "hybrid": (2, True), "replicate": (0, True)}  # full: (1, False)
    for name, r in four[0].items():
        assert (r["mesh_dims"], r["gathered_after_forward"]) == expect[name], name
        assert max_diff(one["weights"], r["weights"]) < 1e-6, name
        for a, b in zip(one["metrics"], r["metrics"], strict=True):
            assert a["vf_loss"] == pytest.approx(b["vf_loss"], rel=1e-6), name
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5), name
        assert r["resumed"] == r["metrics"][-1], name
        assert max_diff(r["resumed_weights"], r["weights"]) == 0.0, name
        # train.replica_check_every holds the critic's replicas too (grad_op has none)
        if name == "grad_op":
            assert r["drift"] is None
        else:
            assert f"replicas drifted apart under train.critic_sharding={name}" in r["drift"]
