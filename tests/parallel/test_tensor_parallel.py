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


def _train(path: str, vocab: int, tp: int) -> dict:
    import dataclasses

    import torch.distributed as dist

    from hybrid_engine.algorithms import policy_loss_fn
    from hybrid_engine.config import AlgorithmConfig, ModelConfig, TrainConfig
    from hybrid_engine.parallel.batch_slices import local_batch
    from hybrid_engine.roles.trainer import Trainer

    trainer = Trainer(path, TrainConfig(lr=LR, grad_clip=1.0, sharding="full", packing=False,
                                        tensor_parallel_size=tp),
                      ModelConfig(compute_dtype="float32"), logits_chunk_tokens=16)
    batch, _ = local_batch(make_trajs(8, vocab), trainer.data_group, pad_id=0,
                           micro_batch_size=2)
    batch = dataclasses.replace(batch, old_logp_BT=trainer.compute_logprobs(batch)[0])
    loss_fn = policy_loss_fn(AlgorithmConfig(clip_low=0.2, clip_high=0.28))
    losses, norms = [], []
    for _ in range(3):
        m = trainer.train_step(batch, loss_fn)
        losses.append(m["loss"])
        norms.append(m["grad_norm"])
    attn = trainer.module.model.layers[0].self_attn
    out = dict(losses=losses, grad_norms=norms, blocks=_blocks_match(trainer.module),
               q_rows=attn.q_proj.weight.to_local().shape[0],
               dp=dist.get_world_size(trainer.data_group),
               weights=full_weights(trainer.module))
    return out if dist.get_rank() == 0 else {"blocks": out["blocks"]}


def _tp_runs(root: str) -> dict:
    import torch.distributed as dist

    from hybrid_engine.models.tiny import TinyModelSpec, write_tiny_model

    specs = {a: TinyModelSpec(**SPECS[a]) for a in ARCHS}
    if dist.get_rank() == 0:
        for a, spec in specs.items():
            write_tiny_model(f"{root}/{a}", spec)
    dist.barrier()
    runs = {(a, dp, tp): _train(f"{root}/{a}", specs[a].vocab_size, tp)
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
