"""Training checkpoints and HF export on real gloo ranks.

One 2-rank run (`_two_rank_checks`) does everything the tests assert on, so the rank
start-up is paid once:
- round trip: 2 steps (warmup + cosine schedule, so the LR state matters), save
  policy + critic + extra; one more step ("continued"). A fresh trainer and critic
  then load the checkpoint; parameters, AdamW state, scheduler state and the RNG
  streams must match the saved ones BITWISE, and the next step must give the same
  loss and weights as the continued run, bitwise (same ranks, same kernels, same
  reduction order: nothing may differ).
- an interrupted save (the shards written, no COMPLETE marker, no rename) is
  rejected; the previous complete checkpoint still loads.
- integrity: a shard with bytes flipped or cut short is named (MANIFEST.json
  checksums) before anything loads it; a save whose writes fail on one rank
  (RLIMIT_FSIZE, as on a full disk) raises one CheckpointWriteError on both
  ranks, leaves no .tmp- folder and the previous checkpoint loads.
- a save before the first optimizer step leaves the next step bitwise unchanged.
- every checkpoint's meta.json records the model its run was made from
  (architecture, config, weights sha256, LoRA rank: what --resume checks first).
- export of a trained untied and a tied model: the HF folder's tensors equal the
  full tensors bitwise, and its logits equal the FSDP model's (max diff 0).
"""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
import torch

from hybrid_engine.testing import run_ranks
from tests.roles.test_trainer import full_weights, make_trajs, rank_batch

SPECS = {
    "untied": dict(arch="qwen2", vocab_size=1001),
    "tied": dict(arch="llama", tie_word_embeddings=True),
    # Mixture-of-Experts: 5 experts over 2 ranks (3, 2); exported one tensor per expert
    "moe": dict(arch="mixtral", num_experts=5, intermediate_size=64, init_std=0.05),
}
TRAIN_KW = dict(lr=1e-3, warmup_steps=3, lr_schedule="cosine", num_steps=10, grad_clip=1.0)


# --------------------------------------------------------------------------
# Helpers (run inside the ranks)
# --------------------------------------------------------------------------


def _roles(path: str, vocab: int, with_critic: bool = True, sharding: str = "full"):
    from hybrid_engine.algorithms import policy_loss_fn
    from hybrid_engine.config import AlgorithmConfig, ModelConfig, TrainConfig
    from hybrid_engine.roles.critic import Critic
    from hybrid_engine.roles.trainer import Trainer

    model_cfg = ModelConfig(compute_dtype="float32")
    trainer = Trainer(path, TrainConfig(**TRAIN_KW, sharding=sharding), model_cfg,
                      logits_chunk_tokens=16)
    critic = Critic(path, TrainConfig(**TRAIN_KW), model_cfg) if with_critic else None
    batch = rank_batch(make_trajs(8, vocab), micro_batch_size=2)
    batch = dataclasses.replace(batch, old_logp_BT=trainer.compute_logprobs(batch)[0])
    return trainer, critic, batch, policy_loss_fn(AlgorithmConfig())


def _step(trainer, critic, batch, loss_fn) -> tuple[float, float]:
    returns = torch.where(batch.loss_mask_BT, (batch.tokens_BT % 7).float() / 7 - 0.5, 0.0)
    old = critic.values(batch)
    critic_loss = critic.train_step(batch, returns, old, clip=0.2, coef=0.5)["vf_loss"]
    return trainer.train_step(batch, loss_fn)["loss"], critic_loss


def _optim_state(optimizer) -> dict[str, torch.Tensor]:
    """Flat param-index/key -> full tensor of the AdamW state (collective)."""
    out = {}
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for i, p in enumerate(params):
        for k, v in optimizer.state[p].items():
            v = v.full_tensor() if hasattr(v, "full_tensor") else v
            out[f"{i}.{k}"] = v.detach().clone()
    return out


def _rng_draws() -> list[float]:
    return [*torch.rand(3).tolist(), random.random(), float(np.random.rand())]


def _snapshot(trainer, critic) -> dict:
    return dict(weights=full_weights(trainer.module), optim=_optim_state(trainer.optimizer),
                sched=trainer.scheduler.state_dict(), step=trainer.step,
                lrs=[g["lr"] for g in trainer.optimizer.param_groups],
                critic_lrs=[g["lr"] for g in critic.optimizer.param_groups],
                critic_weights=full_weights(critic.module),
                critic_optim=_optim_state(critic.optimizer), critic_step=critic.step)


def _same(a: dict, b: dict) -> list[str]:
    """Keys of two snapshots that differ (tensors bitwise)."""
    bad = []
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, dict) and x and isinstance(next(iter(x.values())), torch.Tensor):
            bad += [f"{k}.{n}" for n in x if n not in y or not torch.equal(x[n], y[n])]
            bad += [f"{k}.{n}" for n in y if n not in x]
        elif x != y:
            bad.append(k)
    return bad


def _check_roundtrip(path: str, vocab: int, root: str) -> dict:
    """Save after 2 steps, an interrupted save, load into fresh roles, one more step."""
    from hybrid_engine.checkpoint import load_training_state, save_training_state
    from hybrid_engine.checkpoint.folders import tmp_folder
    from hybrid_engine.checkpoint.state import _write_state

    trainer, critic, batch, loss_fn = _roles(path, vocab)
    torch.manual_seed(1234 + torch.distributed.get_rank())
    for _ in range(2):
        _step(trainer, critic, batch, loss_fn)
    ckpt = f"{root}/ckpt"
    save_training_state(ckpt, trainer=trainer, critic=critic, extra={"rl_step": 1},
                        group=trainer.group)  # replaced
    save_training_state(ckpt, trainer=trainer, critic=critic, extra={"rl_step": 2, "x": [1.5]},
                        group=trainer.group)
    saved = _snapshot(trainer, critic)
    draws = _rng_draws()
    continued = _step(trainer, critic, batch, loss_fn)
    continued_weights = full_weights(trainer.module)
    # A save killed after writing its shards: no marker, never renamed.
    from pathlib import Path

    tmp = tmp_folder(Path(ckpt), trainer.group)
    _write_state(tmp, trainer, critic, {"rl_step": 3}, Path(ckpt), trainer.group)
    torch.distributed.barrier()

    fresh, fresh_critic, _, _ = _roles(path, vocab)
    try:
        load_training_state(tmp, trainer=fresh, critic=fresh_critic, group=fresh.group)
        partial_error = ""
    except ValueError as e:
        partial_error = str(e)
    extra = load_training_state(ckpt, trainer=fresh, critic=fresh_critic, group=fresh.group)
    loaded = _snapshot(fresh, fresh_critic)
    loaded_draws = _rng_draws()
    resumed = _step(fresh, fresh_critic, batch, loss_fn)
    return dict(extra=extra, mismatched=_same(saved, loaded), draws=draws == loaded_draws,
                continued=continued, resumed=resumed, partial_error=partial_error,
                weights_equal=_same({"w": continued_weights}, {"w": full_weights(fresh.module)}),
                saved_step=saved["step"], lr=saved["sched"]["_last_lr"],
                folders=sorted(p.name.split("-")[0] for p in Path(root).iterdir()),
                saved_weights=saved["weights"], saved_optim=saved["optim"])


def _check_layouts(path: str, vocab: int, root: str) -> dict:
    """train.sharding=replicate saved after 2 steps, loaded into a fresh replicate
    trainer and into a `full` one (a resume may change the layout: DCP reshards)."""
    from hybrid_engine.checkpoint import load_training_state, save_training_state

    def snap(t) -> dict:
        return dict(weights=full_weights(t.module), optim=_optim_state(t.optimizer),
                    step=t.step, sched=t.scheduler.state_dict())

    trainer, _, batch, loss_fn = _roles(path, vocab, with_critic=False, sharding="replicate")
    for _ in range(2):
        trainer.train_step(batch, loss_fn)
    save_training_state(f"{root}/ckpt", trainer=trainer, extra={}, group=trainer.group)
    saved = snap(trainer)
    continued = trainer.train_step(batch, loss_fn)["loss"]
    out = {}
    for sharding in ("replicate", "full"):
        fresh, _, _, _ = _roles(path, vocab, with_critic=False, sharding=sharding)
        load_training_state(f"{root}/ckpt", trainer=fresh, group=fresh.group)
        out[sharding] = dict(mismatched=_same(saved, snap(fresh)),
                             resumed=fresh.train_step(batch, loss_fn)["loss"])
    return dict(continued=continued, **out)


def _check_integrity(path: str, vocab: int, root: str) -> dict:
    """Damaged shards are named before loading; a failed write fails on every rank."""
    import resource
    import shutil
    import signal
    from pathlib import Path

    import torch.distributed as dist

    from hybrid_engine.checkpoint import CheckpointWriteError, checkpoint_problem, \
        load_training_state, save_training_state

    trainer, critic, batch, loss_fn = _roles(path, vocab)
    _step(trainer, critic, batch, loss_fn)
    good, out = Path(root) / "good", {}
    save_training_state(good, trainer=trainer, critic=critic, extra={"rl_step": 1},
                        group=trainer.group)
    out["sound"] = checkpoint_problem(good)
    manifest = __import__("json").loads((good / "MANIFEST.json").read_text())
    shard = sorted(n for n in manifest if n.endswith(".distcp"))[-1]
    for how in ("flipped", "short"):
        bad = Path(root) / how
        if dist.get_rank() == 0:
            shutil.copytree(good, bad)
            data = bytearray((bad / shard).read_bytes())
            if how == "flipped":  # bytes in the middle of a tensor: DCP loads it silently
                data[len(data) // 2: len(data) // 2 + 8] = bytes(8)
            else:
                data = data[:-100]
            (bad / shard).write_bytes(bytes(data))
        dist.barrier()
        out[f"{how}_problem"] = checkpoint_problem(bad)
        try:
            load_training_state(bad, trainer=trainer, critic=critic, group=trainer.group)
            out[f"{how}_error"] = ""
        except ValueError as e:
            out[f"{how}_error"] = str(e)
    # A full disk on rank 1 at the next save: its shard write fails (EFBIG).
    _step(trainer, critic, batch, loss_fn)
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    if dist.get_rank() == 1:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, limits[1]))
    try:
        save_training_state(good, trainer=trainer, critic=critic, extra={"rl_step": 2},
                            group=trainer.group)
        out["write_error"] = ""
    except CheckpointWriteError as e:
        out["write_error"] = str(e)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
    dist.barrier()
    out["left"] = sorted(p.name for p in Path(root).iterdir())
    out["after_failed_save"] = load_training_state(good, trainer=trainer, critic=critic,
                                                   group=trainer.group)
    return out


def _check_export(path: str, vocab: int, out: str) -> dict:
    """Trains 2 steps, exports, compares the HF folder with the FSDP model on rank 0."""
    import torch.distributed as dist

    from hybrid_engine.checkpoint import export_hf

    trainer, _, batch, loss_fn = _roles(path, vocab, with_critic=False)
    for _ in range(2):
        trainer.train_step(batch, loss_fn)
    export_hf(out, model=trainer, hf_config_source=path)
    export_hf(f"{out}_split", model=trainer.module, hf_config_source=path, max_shard_bytes=100_000)
    full = full_weights(trainer.module)
    with torch.no_grad():
        hidden = trainer.module(input_ids=batch.tokens_BT, attention_mask=batch.attention_mask_BT,
                                position_ids=batch.position_ids_BT, use_cache=False).logits
        fsdp_logits = hidden @ trainer.module.lm_head.weight.t()
    trainer.module.reshard()
    if dist.get_rank() != 0:
        return {}
    import os

    import safetensors
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with safetensors.safe_open(f"{out}/model.safetensors", "pt") as f:
        file_names = sorted(f.keys())
    split = AutoModelForCausalLM.from_pretrained(f"{out}_split")
    split_equal = all(torch.equal(p, full[n]) for n, p in split.named_parameters())
    model = AutoModelForCausalLM.from_pretrained(out)
    loaded = {n: p.detach() for n, p in model.named_parameters()}
    with torch.no_grad():
        hf_logits = model(input_ids=batch.tokens_BT, attention_mask=batch.attention_mask_BT,
                          position_ids=batch.position_ids_BT).logits
    from hybrid_engine.models.experts import checkpoint_tensors

    expected = sorted(checkpoint_tensors(model.config.model_type, full))  # MoE: per expert
    return dict(file_names=file_names, expected_names=expected, dtype=str(model.dtype),
                weights_equal=all(torch.equal(loaded[n], full[n]) for n in full),
                tied=model.lm_head.weight is model.model.embed_tokens.weight,
                logits_diff=float((hf_logits - fsdp_logits).abs().max()),
                tokenizer_vocab=len(AutoTokenizer.from_pretrained(out)),
                files=sorted(os.listdir(out)), split_equal=split_equal,
                split_files=sum(f.endswith(".safetensors") for f in os.listdir(f"{out}_split")))


def _check_save_before_training(path: str, vocab: int, root: str) -> dict:
    """A save before the first optimizer step (DCP makes the AdamW state then) must
    not change the training that follows: bitwise the same step as without it."""
    from hybrid_engine.checkpoint import save_training_state

    runs = []
    for save in (False, True):
        trainer, critic, batch, loss_fn = _roles(path, vocab)
        if save:
            save_training_state(f"{root}/fresh", trainer=trainer, critic=critic,
                                group=trainer.group)
        _step(trainer, critic, batch, loss_fn)
        runs.append(_snapshot(trainer, critic))
    return {"differ": _same(*runs)}


def _save_lora(path: str, root: str) -> None:
    """A LoRA policy's checkpoint before any step (its record: the adapters' rank)."""
    from hybrid_engine.checkpoint import save_training_state
    from hybrid_engine.config import ModelConfig, TrainConfig
    from hybrid_engine.roles.trainer import Trainer

    trainer = Trainer(path, TrainConfig(**TRAIN_KW),
                      ModelConfig(compute_dtype="float32", lora_rank=6), logits_chunk_tokens=16)
    save_training_state(f"{root}/lora", trainer=trainer, group=trainer.group)


def _two_rank_checks(root: str) -> dict:
    import torch.distributed as dist

    from hybrid_engine.models.tiny import TinyModelSpec, write_tiny_model

    if dist.get_rank() == 0:
        for name, kw in SPECS.items():
            write_tiny_model(f"{root}/{name}", TinyModelSpec(**kw))
    dist.barrier()
    vocab = {name: TinyModelSpec(**kw).vocab_size for name, kw in SPECS.items()}
    return dict(
        roundtrip={name: _check_roundtrip(f"{root}/{name}", vocab[name], f"{root}/rt_{name}")
                   for name in SPECS},
        export={name: _check_export(f"{root}/{name}", vocab[name], f"{root}/export_{name}")
                for name in SPECS},
        integrity=_check_integrity(f"{root}/untied", vocab["untied"], f"{root}/integrity"),
        layouts=_check_layouts(f"{root}/untied", vocab["untied"], f"{root}/layouts"),
        fresh=_check_save_before_training(f"{root}/untied", vocab["untied"], f"{root}/fresh"),
        lora=_save_lora(f"{root}/untied", root),
    )


def _one_rank_load(root: str) -> dict:
    """Loads the 2-rank checkpoint on 1 rank (DCP reshards model and optimizer)."""
    from hybrid_engine.checkpoint import load_training_state

    trainer, critic, _, _ = _roles(f"{root}/untied", SPECS["untied"]["vocab_size"])
    extra = load_training_state(f"{root}/rt_untied/ckpt", trainer=trainer, critic=critic,
                                group=trainer.group)
    return dict(extra=extra, weights=full_weights(trainer.module),
                optim=_optim_state(trainer.optimizer), step=trainer.step)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("checkpoint"))


@pytest.fixture(scope="module")
def two_ranks(root) -> list[dict]:
    return run_ranks(_two_rank_checks, 2, root, timeout=300)


# --------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------


def test_a_save_before_the_first_step_changes_nothing(two_ranks):
    for r in two_ranks:
        assert r["fresh"]["differ"] == []


def test_load_rejects_folder_without_marker(tmp_path):
    from hybrid_engine.checkpoint import load_training_state

    (tmp_path / "ckpt").mkdir()
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        load_training_state(tmp_path / "ckpt", trainer=None, group=None)
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        load_training_state(tmp_path / "missing", trainer=None, group=None)


@pytest.mark.parametrize("name", list(SPECS))
def test_roundtrip_is_bitwise(two_ranks, name):
    for r in two_ranks:
        rt = r["roundtrip"][name]
        assert rt["extra"] == {"rl_step": 2, "x": [1.5]}
        assert rt["saved_step"] == 2 and rt["lr"][0] != TRAIN_KW["lr"]  # inside the schedule
        assert rt["mismatched"] == []
        assert sum(k.endswith("exp_avg_sq") for k in rt["saved_optim"]) == len(rt["saved_weights"])
        assert rt["draws"]


@pytest.mark.parametrize("name", list(SPECS))
def test_step_after_load_equals_continuing(two_ranks, name):
    for r in two_ranks:
        rt = r["roundtrip"][name]
        assert rt["resumed"] == rt["continued"]  # (policy loss, critic loss), bitwise
        assert rt["weights_equal"] == []


@pytest.mark.parametrize("name", list(SPECS))
def test_a_checkpoint_records_the_model_it_was_made_from(two_ranks, root, name):
    """What --resume compares before any engine starts (tests/test_resume_model.py)."""
    import json
    from pathlib import Path

    from hybrid_engine.checkpoint.origin import weights_digest
    from hybrid_engine.models.tiny import TinyModelSpec

    model = f"{root}/{name}"
    origin = json.loads(Path(f"{root}/rt_{name}/ckpt/meta.json").read_text())["origin"]
    arch = {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM",
            "mixtral": "MixtralForCausalLM"}[SPECS[name]["arch"]]
    assert (origin["architecture"], origin["path"], origin["lora_rank"]) == (arch, model, 0)
    assert origin["sha256"] == weights_digest(model)
    assert origin["config"]["vocab_size"] == TinyModelSpec(**SPECS[name]).vocab_size
    assert list(origin["files"]) == ["model.safetensors"]
    if name == "untied":
        lora = json.loads(Path(f"{root}/lora/meta.json").read_text())["origin"]
        assert (lora["lora_rank"], lora["sha256"]) == (6, origin["sha256"])


def test_replicated_layout_saves_and_resumes_in_any_layout(two_ranks):
    """A train.sharding=replicate checkpoint loads bitwise into replicate and into
    full (weights, AdamW state, schedule), and the next step equals continuing."""
    for r in two_ranks:
        lay = r["layouts"]
        for sharding in ("replicate", "full"):
            assert lay[sharding]["mismatched"] == [], sharding
        assert lay["replicate"]["resumed"] == lay["continued"]
        assert lay["full"]["resumed"] == pytest.approx(lay["continued"], rel=1e-6)


def test_interrupted_save_is_rejected_and_previous_loads(two_ranks):
    for r in two_ranks:
        rt = r["roundtrip"]["untied"]
        assert "not a complete checkpoint" in rt["partial_error"]
        assert ".tmp-" in rt["partial_error"]
        assert rt["extra"]["rl_step"] == 2  # the earlier checkpoint, not the partial one
        # The replaced checkpoint was deleted; only the interrupted save's folder is left.
        assert rt["folders"] == ["ckpt", "ckpt.tmp"]


def test_damaged_checkpoint_is_named_before_it_loads(two_ranks):
    """Bytes flipped inside a shard would load silently (DCP has no checksum),
    and a shard cut short would give a raw traceback: both are named first."""
    for r in two_ranks:
        ig = r["integrity"]
        assert ig["sound"] is None
        assert ig["flipped_problem"].endswith("does not match its checksum")
        assert "bytes," in ig["short_problem"] and "were written" in ig["short_problem"]
        for how in ("flipped", "short"):
            assert ig[f"{how}_error"].startswith("checkpoint ") and " is damaged: " in \
                ig[f"{how}_error"], ig[f"{how}_error"]


def test_failed_save_fails_on_every_rank_and_keeps_the_previous(two_ranks):
    """A write that fails on one rank (a full disk) used to leave the other rank
    in a collective and print torch's 'inline_container' text; now both ranks
    raise one error that says why, and nothing half-written stays."""
    for r in two_ranks:
        ig = r["integrity"]
        assert "could not write checkpoint" in ig["write_error"], ig["write_error"]
        assert "rank 1: no space left on device" in ig["write_error"]
        assert "previous checkpoint is intact" in ig["write_error"]
        assert not [n for n in ig["left"] if ".tmp-" in n], ig["left"]
        assert ig["after_failed_save"] == {"rl_step": 1}


def test_load_on_another_rank_count(two_ranks, root):
    one = run_ranks(_one_rank_load, 1, root, timeout=120)[0]
    saved = two_ranks[0]["roundtrip"]["untied"]
    assert one["extra"]["rl_step"] == 2 and one["step"] == 2
    assert all(torch.equal(one["weights"][k], v) for k, v in saved["saved_weights"].items())
    assert all(torch.equal(one["optim"][k], v) for k, v in saved["saved_optim"].items())


@pytest.mark.parametrize("name", list(SPECS))
def test_export_loads_in_transformers_with_identical_logits(two_ranks, name):
    ex = two_ranks[0]["export"][name]
    assert ex["file_names"] == ex["expected_names"]
    assert ("lm_head.weight" in ex["file_names"]) == (name != "tied")
    assert ex["tied"] == (name == "tied")
    if name == "moe":
        assert "model.layers.0.block_sparse_moe.experts.4.w3.weight" in ex["file_names"]
    assert ex["weights_equal"]
    assert ex["split_equal"] and ex["split_files"] > 1  # indexed multi-file layout
    assert ex["dtype"] == "torch.float32"
    assert ex["logits_diff"] == 0.0
    assert ex["tokenizer_vocab"] > 0
    assert {"config.json", "generation_config.json", "tokenizer.json", "COMPLETE"} <= set(
        ex["files"])


@pytest.mark.slow
@pytest.mark.vllm
def test_export_loads_in_vllm(two_ranks, root):
    """The exported folders serve in vLLM (CPU, fp32) with the same ids and
    logprobs as transformers computes from them."""
    from tests.models._vllm_check import check_in_fresh_process

    paths = [f"{root}/export_{name}" for name in SPECS]
    results = check_in_fresh_process(paths)
    for path in paths:
        assert results[path]["prompt_ids_equal"], path
        assert results[path]["max_abs_diff"] < 1e-4, (path, results[path]["max_abs_diff"])
    moe = results[f"{root}/export_moe"]  # every token of every layer routed as HF routes it
    assert moe["experts_routed"] > 4 * 16 * 2 and moe["experts_mismatch"] == 0, moe
