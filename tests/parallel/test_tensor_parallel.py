"""TP inside, FSDP2 across (train.tensor_parallel_size): 4 real gloo ranks, meshes
2x2 and 1x4, against a plain transformers model trained in one process.

One 4-rank launch trains Qwen2, Llama (tied) and Qwen3-MoE (per-head q/k norms,
experts not split) for 3 steps on each mesh. 1x4 has fewer KV heads (2) than TP
ranks: k/v stay whole and each rank keeps its KV head. Tolerances are the
trainer parity test's (`tests/roles/test_trainer.py`): fp32, lr 2e-5.
"""

from __future__ import annotations

import pytest
import torch

from hybrid_engine.testing import run_ranks
from tests.roles.test_trainer import (LR, SPECS, WEIGHT_ATOL, _to_numpy, full_weights, make_trajs,
                                      max_diff, plain_training)

ARCHS = ("qwen2", "llama", "qwen3_moe")
MESHES = ((2, 2), (1, 4))  # (dp, tp)


def _blocks_match(module) -> bool:
    """Every parameter's local tensor is the block `local_block` names of its full tensor."""
    from hybrid_engine.parallel.params import local_block, sharded_named_parameters

    for _, p in sharded_named_parameters(module):
        (a, b), cols = local_block(p)
        full = p.full_tensor()
        block = full[a:b] if cols is None else full[a:b, cols[0]:cols[1]]
        if not torch.equal(block, p.to_local()):
            return False
    return True


def _trainer(path: str, tp: int):  # noqa: ANN202
    from hybrid_engine.config import ModelConfig, TrainConfig
    from hybrid_engine.roles.trainer import Trainer

    return Trainer(path, TrainConfig(lr=LR, grad_clip=1.0, sharding="full", packing=False,
                                     tensor_parallel_size=tp, replica_check_every=1),
                   ModelConfig(compute_dtype="float32"), logits_chunk_tokens=16)


def _train(path: str, vocab: int, tp: int, more: str | None = None) -> dict:
    """3 steps; more="checks": also resume from a checkpoint of step 2, export, and
    drift one TP rank's copy of an unsplit weight."""
    import dataclasses

    import torch.distributed as dist

    from hybrid_engine.algorithms import policy_loss_fn
    from hybrid_engine.config import AlgorithmConfig
    from hybrid_engine.parallel.batch_slices import local_batch

    trainer = _trainer(path, tp)
    batch, _ = local_batch(make_trajs(8, vocab), trainer.data_group, pad_id=0,
                           micro_batch_size=2)
    batch = dataclasses.replace(batch, old_logp_BT=trainer.compute_logprobs(batch)[0])
    loss_fn = policy_loss_fn(AlgorithmConfig(clip_low=0.2, clip_high=0.28))
    losses, norms = [], []
    for step in range(3):
        if step == 2 and more:
            _save(trainer, f"{path}-ckpt")
        m = trainer.train_step(batch, loss_fn)
        losses.append(m["loss"])
        norms.append(m["grad_norm"])
    attn = trainer.module.model.layers[0].self_attn
    out = dict(losses=losses, grad_norms=norms, blocks=_blocks_match(trainer.module),
               q_rows=attn.q_proj.weight.to_local().shape[0],
               dp=dist.get_world_size(trainer.data_group),
               weights=full_weights(trainer.module))
    if more:
        out |= _resume_export_drift(path, tp, trainer, batch, loss_fn, out)
    return out if dist.get_rank() == 0 else {"blocks": out["blocks"],
                                              "drift": out.get("drift")}


def _save(trainer, folder: str) -> None:  # noqa: ANN001
    from hybrid_engine.checkpoint.state import save_training_state

    save_training_state(folder, trainer=trainer, group=trainer.group)


def _resume_export_drift(path: str, tp: int, trainer, batch, loss_fn, out: dict) -> dict:  # noqa: ANN001
    """Step 3 again from the checkpoint of step 2 on a fresh trainer; the HF export of
    the trained weights; then one TP rank's copy of the final norm nudged by an ulp."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from hybrid_engine.checkpoint.export import export_hf
    from hybrid_engine.checkpoint.state import load_training_state
    from hybrid_engine.guards import RunAborted

    fresh = _trainer(path, tp)
    load_training_state(f"{path}-ckpt", trainer=fresh, group=fresh.group)
    m = fresh.train_step(batch, loss_fn)
    resumed = dict(loss=m["loss"], grad_norm=m["grad_norm"], weights=full_weights(fresh.module))
    export_hf(f"{path}-export", model=trainer, hf_config_source=path, group=trainer.group)
    exported = None
    if dist.get_rank() == 0:  # as transformers reads it back (experts fused again)
        state = AutoModelForCausalLM.from_pretrained(f"{path}-export").state_dict()
        exported = {n: state[n] for n in out["weights"]}
    norm = trainer.module.model.norm.weight.to_local()
    if dist.get_rank(trainer.tp_group) == 1:
        with torch.no_grad():
            norm.view(torch.int32)[0] += 1
    try:
        trainer.train_step(batch, loss_fn)
        drift = None
    except RunAborted as e:
        drift = str(e)
    return dict(resumed=resumed, exported=exported, drift=drift)


def _tp_runs(root: str) -> dict:
    import torch.distributed as dist

    from hybrid_engine.models.tiny import TinyModelSpec, write_tiny_model

    specs = {a: TinyModelSpec(**SPECS[a]) for a in ARCHS}
    if dist.get_rank() == 0:
        for a, spec in specs.items():
            write_tiny_model(f"{root}/{a}", spec)
    dist.barrier()
    runs = {(a, dp, tp): _train(f"{root}/{a}", specs[a].vocab_size, tp,
                                "checks" if (a, dp) == ("qwen3_moe", 2) else None)
            for a in ARCHS for dp, tp in MESHES}
    if dist.get_rank() == 0:
        runs |= {(a, "plain"): plain_training(f"{root}/{a}", 3, specs[a].vocab_size)
                 for a in ARCHS}
    return _to_numpy(runs)


@pytest.fixture(scope="module")
def tp_runs(tmp_path_factory) -> list[dict]:
    return run_ranks(_tp_runs, 4, str(tmp_path_factory.mktemp("tp")), timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("dp,tp", MESHES)
@pytest.mark.parametrize("arch", ARCHS)
def test_tp_training_matches_one_process(tp_runs, arch, dp, tp):
    """Losses, pre-clip gradient norms and weights after 3 steps equal a plain
    one-process model's to fp32 tolerance; each rank holds the block the layout
    names (TP split, then FSDP2 rows), the q projection split tp ways."""
    run, plain = tp_runs[0][(arch, dp, tp)], tp_runs[0][(arch, "plain")]
    assert all(r[(arch, dp, tp)]["blocks"] for r in tp_runs)
    q_rows = SPECS[arch].get("num_heads", 4) * (SPECS[arch].get("hidden_size", 128) // 4)
    assert run["q_rows"] == q_rows // tp // dp
    assert run["dp"] == dp
    assert plain["losses"][-1] < plain["losses"][0]
    assert run["losses"] == pytest.approx(plain["losses"], rel=1e-6)
    assert run["grad_norms"] == pytest.approx(plain["grad_norms"], rel=1e-5)
    assert max_diff(run["weights"], plain["weights"]) < WEIGHT_ATOL


@pytest.mark.slow
def test_tp_training_resumes_exactly_exports_and_checks_its_replicas(tp_runs):
    """Qwen3-MoE on the 2x2 mesh: step 3 from a DCP checkpoint of step 2, on a freshly
    built trainer, gives the uninterrupted step 3 bit for bit (loss, gradient norm,
    weights); the HF export holds the full trained weights; and a weight no TP rank
    splits, nudged by an ulp on one TP rank, stops the run at the next step's check
    (train.replica_check_every=1) on every rank."""
    run = tp_runs[0][("qwen3_moe", 2, 2)]
    assert run["resumed"]["loss"] == run["losses"][2]
    assert run["resumed"]["grad_norm"] == run["grad_norms"][2]
    assert max_diff(run["resumed"]["weights"], run["weights"]) == 0.0
    assert max_diff(run["exported"], run["weights"]) == 0.0
    for r in tp_runs:
        assert "replicas drifted apart under train.tensor_parallel_size=2" in r[("qwen3_moe", 2, 2)]["drift"]
