"""LoRA on every training layout, on real gloo ranks, against a 1-process PEFT model.

The reference is a plain transformers model with PEFT's LoRA layers, the same
adapter init (`parallel/lora.init_adapters`: seeded by name) and the whole batch
at once. Every layout (full, grad_op and replicate on 2 ranks; hybrid as 2 shard
groups of 2 on 4) trains 3 steps; the trained model (W0 + (alpha / r) B A) then
agrees with the reference's to < 1e-6 relative, the losses and gradient norms to
fp32 rounding, and the base weights are the file's, bit for bit. The adapters
themselves agree to 1% of one step per element: B starts at zero, so it is all
update, and AdamW turns the rounding of a gradient element near its eps (1e-8)
into a visible part of that element's step (measured: 7e-9 of a 6e-5 element).
Non-default rank, alpha and targets, so a knob that was ignored would break the
parity. The same launch checks the merged sources and export, the reference, bf16
compute and an exact resume. Two more launches run an engine each: the merged
sync into vLLM, and the adapter sync (sync.lora=adapter)."""

from __future__ import annotations

import pytest
import torch

from hybrid_engine.reshard.adapters import LoraDims
from hybrid_engine.reshard.layouts import model_dims
from hybrid_engine.testing import run_ranks
from tests.reshard.test_adapters import min_elements
from tests.roles.test_trainer import (LR, _to_numpy, full_weights, plain_training,
                                      start_run)

LORA = dict(lora_rank=4, lora_alpha=8.0, lora_target_modules=("q_proj", "v_proj", "down_proj"))
VOCAB = 1001
LAYOUTS = {2: [("full", 0), ("grad_op", 0), ("replicate", 0)], 4: [("hybrid", 2)]}


def _model(root: str) -> str:
    import torch.distributed as dist

    from hybrid_engine.models.tiny import TinyModelSpec, write_tiny_model

    path = f"{root}/qwen2_lora"
    if dist.get_rank() == 0:
        write_tiny_model(path, TinyModelSpec(arch="qwen2", vocab_size=VOCAB))
    dist.barrier()
    return path


def _layouts(root: str, steps: int, layouts: list, dropout: bool) -> list:
    """Per (sharding, shard_group_size): losses, gradient norms, full weights after
    `steps` steps; with dropout, also a full-sharding run at lora_dropout 0.5
    (its gradient norms, and whether two scorings of one batch agree)."""
    path, outs, runs = _model(root), [], {}
    for sharding, size in layouts:
        run = runs[sharding] = start_run(path, {"micro_batch_size": 2}, vocab=VOCAB,
                                         sharding=sharding, shard_group_size=size,
                                         model_kw=LORA).steps(steps)
        outs.append(dict(losses=run.losses, grad_norms=run.grad_norms,
                         weights=full_weights(run.trainer.module),
                         trainable=sorted(n for n, p in run.trainer.module.named_parameters()
                                          if p.requires_grad),
                         adapter_bytes=_adapter_syncs(run.trainer.module,
                                                      1 if sharding == "replicate" else size)))
    if dropout:
        outs.append({**_merged(path, runs["full"], root), **_reference(path, runs["full"]),
                     **_bf16(path), **_resume(path, root)})
        run = start_run(path, {"micro_batch_size": 2}, vocab=VOCAB,
                        model_kw={**LORA, "lora_dropout": 0.5}).steps(steps)
        first, second = (run.trainer.compute_logprobs(run.batch)[0] for _ in range(2))
        outs.append(dict(grad_norms=run.grad_norms, scoring_repeats=bool(torch.equal(first,
                                                                                   second))))
    return _to_numpy(outs)


def _adapter_syncs(module, size: int) -> dict[int, float]:  # noqa: ANN001
    """sync.lora=adapter from this layout at every TP size T dividing the world,
    verified (every element each TP rank's LoRA layers read checked bit for bit
    against the whole adapters; a mismatch raises): T -> bytes this rank received."""
    import torch.distributed as dist

    from hybrid_engine.config import ModelConfig, SyncConfig
    from hybrid_engine.roles.sync import WeightSync

    world, out = dist.get_world_size(), {}  # size 0: one shard group of every rank
    for tp in (t for t in (1, 2, 4) if world % t == 0):
        sync = WeightSync(module.config, SyncConfig(lora="adapter", verify=True, bucket_mb=0.01),
                          tp=tp, wire_dtype=torch.float32, shard_group_size=size or None,
                          adapter=ModelConfig(**LORA))
        out[tp] = sync.sync(module, None)["sync_bytes_received"]
    return out


def _expected_merge(weights: dict) -> dict:
    """W0 + (alpha / r) B A of every adapted weight, from the full tensors."""
    scale, out = LORA["lora_alpha"] / LORA["lora_rank"], {}
    for a in (n for n in weights if ".lora_A." in n):
        base = a.split(".lora_A.")[0] + ".weight"
        b = weights[a.replace(".lora_A.", ".lora_B.")]
        out[base] = weights[base].float() + scale * (b.float() @ weights[a].float())
    return out


def _merged(path: str, run, root: str) -> dict:  # noqa: ANN001
    """The sync's sources (this rank's rows) and the export of a LoRA model: the
    adapted weights merged, W0 + (alpha / r) B A, the adapters absent."""
    import torch.distributed as dist
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from hybrid_engine.checkpoint.export import export_adapter, export_hf
    from hybrid_engine.config import ModelConfig, SyncConfig
    from hybrid_engine.parallel.params import local_rows
    from hybrid_engine.roles.sync import WeightSync

    module = run.trainer.module
    expected = _expected_merge(full_weights(module))
    sync = WeightSync(AutoConfig.from_pretrained(path), SyncConfig(), tp=2,
                      wire_dtype=torch.float32)
    sources, params = sync.sources(module), dict(module.named_parameters())
    exact = True
    for name, want in expected.items():
        base = params[name.replace(".weight", ".base_layer.weight")]
        r0, r1 = local_rows(base)
        exact &= torch.equal(sources[name].view(-1), want[r0:r1].reshape(-1))
    export_hf(f"{root}/exported", model=run.trainer, hf_config_source=path)
    export_adapter(f"{root}/adapter", model=run.trainer, lora=ModelConfig(**LORA),
                   base_model=path)
    dist.barrier()
    written = load_file(f"{root}/exported/model.safetensors")
    return dict(sources_exact=exact, sources_keys=sorted(sources) == sorted(sync.plan.hf_shapes),
                export_exact=all(torch.equal(written[n], w) for n, w in expected.items()),
                export_keys=not any(".lora_" in n or "base_layer" in n for n in written),
                adapter_exact=_peft_merge(f"{root}/adapter", expected))


def _peft_merge(folder: str, expected: dict) -> bool:
    """The PEFT adapter folder, loaded by PEFT onto the base it names and merged,
    gives W0 + (alpha / r) B A."""
    import json

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tests.roles.test_trainer import max_diff

    base = json.loads(open(f"{folder}/adapter_config.json").read())["base_model_name_or_path"]
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(
        base, dtype=torch.float32), folder).merge_and_unload().state_dict()
    return max_diff({n: peft[n] for n in expected}, expected) < 1e-6


def _bf16(path: str) -> dict:
    """bf16 compute: the frozen base is held in bf16 (no fp32 master), the adapters in
    fp32 with the only AdamW state, and training runs."""
    run = start_run(path, {"micro_batch_size": 2}, vocab=VOCAB, compute_dtype="bfloat16",
                    model_kw=LORA).steps(2)
    params = dict(run.trainer.module.named_parameters())
    adapters = {n: p for n, p in params.items() if ".lora_" in n}
    local = sum(p.to_local().nbytes for p in adapters.values())
    return dict(bf16_base={p.dtype for n, p in params.items() if n not in adapters}
                == {torch.bfloat16},
                fp32_adapters={p.dtype for p in adapters.values()} == {torch.float32},
                bf16_optimizer=run.trainer.optimizer_state_bytes() == 2 * local
                and all(len(run.trainer.optimizer.state[p]) for p in adapters.values()),
                bf16_trains=all(x == x for x in run.losses) and run.trainer.step == 2)


def _resume(path: str, root: str) -> dict:
    """A checkpoint after 2 steps holds the adapters (and their AdamW state) only;
    restored into a fresh trainer, the next step is the straight run's, bit for bit;
    it is refused by a trainer on another base and by one without LoRA."""
    import shutil

    import torch.distributed as dist
    from safetensors.torch import load_file, save_file

    from hybrid_engine.checkpoint import load_training_state, save_training_state
    from hybrid_engine.checkpoint.state import weights_digest

    straight = start_run(path, {"micro_batch_size": 2}, vocab=VOCAB, model_kw=LORA).steps(2)
    ckpt = f"{root}/lora_ckpt"
    save_training_state(ckpt, trainer=straight.trainer, group=straight.trainer.group)
    straight.steps(1)
    resumed = start_run(path, {"micro_batch_size": 2}, vocab=VOCAB, model_kw=LORA)
    load_training_state(ckpt, trainer=resumed.trainer, group=resumed.trainer.group)
    resumed.steps(1)
    other = f"{root}/other_base"  # the same shapes, one weight changed
    if dist.get_rank() == 0:
        shutil.copytree(path, other)
        w = load_file(f"{other}/model.safetensors")
        w["model.norm.weight"] += 1
        save_file(w, f"{other}/model.safetensors", metadata={"format": "pt"})
    dist.barrier()
    refusals = []
    for model, kw in ((other, LORA), (path, {})):
        try:
            load_training_state(ckpt, trainer=start_run(model, {"micro_batch_size": 2},
                                                        vocab=VOCAB, model_kw=kw).trainer,
                                group=None)
        except ValueError as e:
            refusals.append(str(e))
    a, b = full_weights(straight.trainer.module), full_weights(resumed.trainer.module)
    return dict(resume_exact=all(torch.equal(a[n], b[n]) for n in a)
                and straight.losses[-1] == resumed.losses[-1],
                resume_refusals=len(refusals) == 2
                and "whose weights differ from those of model.path" in refusals[0]
                and "holds LoRA adapters, but this run has model.lora_rank=0" in refusals[1],
                resume_digest=weights_digest(path) != weights_digest(other))


def _reference(path: str, run) -> dict:  # noqa: ANN001
    """The reference of a LoRA policy (its model, adapters bypassed) vs a copy of
    the base loaded apart, on the trained adapters."""
    from hybrid_engine.config import ModelConfig
    from hybrid_engine.roles.reference import Reference

    trainer = run.trainer
    shared = Reference(path, ModelConfig(), trainer.mesh, logits_chunk_tokens=16,
                       adapted=trainer.module).score(run.batch)
    apart = Reference(path, ModelConfig(compute_dtype="float32"),
                      logits_chunk_tokens=16).score(run.batch)
    policy = trainer.compute_logprobs(run.batch)[0]
    return dict(reference_exact=bool(torch.equal(shared, apart)),
                policy_differs=not torch.equal(policy, shared))


def _peft_reference(path: str, steps: int) -> dict:
    """The whole batch in one process: transformers + PEFT, AdamW over the adapters."""
    from hybrid_engine.config import ModelConfig
    from hybrid_engine.parallel.lora import add_adapters, init_adapters

    def adapt(model):  # noqa: ANN001, ANN202
        model = add_adapters(model, ModelConfig(**LORA), torch.float32)
        init_adapters(model)
        return model

    return _to_numpy(plain_training(path, steps, VOCAB, adapt))


def _file_weights(path: str) -> dict:
    from safetensors.torch import load_file

    return _to_numpy(load_file(f"{path}/model.safetensors"))


def _assert_adapter_bytes(path: str, runs: dict) -> None:
    """sync.lora=adapter: each rank received exactly the adapter elements its TP
    rank's LoRA layers read and it does not hold (rank 0's count, per layout and T)."""
    from transformers import AutoConfig

    dims, lora = model_dims(AutoConfig.from_pretrained(path)), LoraDims(
        LORA["lora_rank"], LORA["lora_target_modules"])
    for name, r in runs.items():
        world, sharding = name.split()
        size = {"replicate": 1, "hybrid": 2}.get(sharding, int(world))
        assert sorted(r["adapter_bytes"]) == [t for t in (1, 2, 4) if int(world) % t == 0]
        assert r["adapter_bytes"] == {tp: 4.0 * min_elements(dims, lora, int(world), tp, size, 0)
                                      for tp in r["adapter_bytes"]}, name
        if sharding == "replicate":
            assert set(r["adapter_bytes"].values()) == {0.0}


@pytest.mark.slow
def test_lora_on_every_layout_equals_a_one_process_peft_model(tmp_path) -> None:
    runs = {}
    for world, layouts in LAYOUTS.items():
        outs = run_ranks(_layouts, world, str(tmp_path), 3, layouts, world == 2,
                         timeout=300)[0]
        runs.update({f"{world} {s}": out for (s, _), out in zip(layouts, outs)})
        if world == 2:
            merged, dropped = outs[-2], outs[-1]
    path = f"{tmp_path}/qwen2_lora"
    ref, base = _peft_reference(path, 3), _file_weights(path)
    adapters = sorted(n for n in ref["weights"] if ".lora_" in n)
    assert len(adapters) == 2 * 3 * 2  # A and B of 3 targets in each of 2 layers
    r = LORA["lora_rank"]  # model.lora_rank: A is [r, in], B is [out, r]
    assert all(ref["weights"][n].shape[0 if ".lora_A." in n else 1] == r for n in adapters)
    for name, out in runs.items():
        assert all(out["weights"][n].shape == ref["weights"][n].shape for n in adapters), name
    assert ref["losses"][-1] < ref["losses"][0]
    _assert_adapter_bytes(path, runs)
    for name, r in runs.items():
        assert len(r["trainable"]) == len(adapters), name  # only the adapters train
        assert all(".lora_" in n for n in r["trainable"]), name
        assert r["losses"] == pytest.approx(ref["losses"], rel=1e-6), name
        assert r["grad_norms"] == pytest.approx(ref["grad_norms"], rel=1e-5), name
        ours = {k: torch.as_tensor(v) for k, v in r["weights"].items()}
        theirs = {k: torch.as_tensor(v) for k, v in ref["weights"].items()}
        for n in adapters:  # every element's 3 updates agree to 1% of one step
            assert float((ours[n] - theirs[n]).abs().max()) < 1e-2 * LR, (name, n)
        mine, want = _expected_merge(ours), _expected_merge(theirs)
        for n in want:  # the trained model: W0 + (alpha / r) B A, < 1e-6 relative
            assert float((mine[n] - want[n]).norm() / want[n].norm()) < 1e-6, (name, n)
        assert float(abs(ref["weights"][adapters[1]]).max()) > 0  # B moved off its zero init
        for n, w in base.items():  # the frozen base: the file's bytes
            assert (r["weights"][n] == w).all(), (name, n)
    # The weight sync's sources and the export hold the merged weights, bit for bit,
    # and the reference is the base: the policy bypassing its adapters.
    assert merged == dict(sources_exact=True, sources_keys=True, export_exact=True,
                          export_keys=True, adapter_exact=True, reference_exact=True,
                          policy_differs=True,
                          bf16_base=True, fp32_adapters=True, bf16_optimizer=True,
                          bf16_trains=True, resume_exact=True, resume_refusals=True,
                          resume_digest=True)
    # model.lora_dropout: training forwards differ, scoring repeats exactly.
    assert dropped["grad_norms"] != pytest.approx(runs["2 full"]["grad_norms"], rel=1e-3)
    assert dropped["scoring_repeats"]


def _merge_sync(root: str) -> dict:
    """A LoRA trainer (2 ranks, full sharding) synced into a TP=2 engine by the
    verified reshard (each written weight checked bit for bit against vLLM's own
    loader of the merged full tensors), after training and after 50 more syncs;
    then vLLM's log-probs against a transformers model holding W0 + (alpha/r) B A."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from hybrid_engine.config import SyncConfig
    from hybrid_engine.roles.sync import WeightSync
    from tests.roles.test_sync import _engine, _greedy, _max_logprob_diff

    path = _model(root)
    run = start_run(path, {"micro_batch_size": 2}, vocab=VOCAB, model_kw=LORA)
    module, rollout = run.trainer.module, _engine(path, 2, "float32")
    before = _greedy(rollout, 8)
    run.steps(3)
    sync = WeightSync(module.config, SyncConfig(bucket_mb=0.05, verify=True), tp=2,
                      wire_dtype=torch.float32)
    first = sync.sync(module, rollout)
    after = _greedy(rollout, 8)
    fast = WeightSync(module.config, SyncConfig(bucket_mb=0.05), tp=2, wire_dtype=torch.float32)
    for _ in range(50):
        fast.sync(module, rollout)
    last = sync.sync(module, rollout)  # verified again: W0 never absorbed an update
    again = _greedy(rollout, 8)
    merged = _expected_merge(full_weights(module))
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ref.load_state_dict(merged, strict=False)
    out = dict(changed=before.token_ids != after.token_ids or before.logprobs != after.logprobs,
               repeat=again.token_ids == after.token_ids and again.logprobs == after.logprobs,
               max_diff=_max_logprob_diff(ref, after),
               bytes=[first["sync_bytes_received"], last["sync_bytes_received"]],
               min_bytes=sync.plan.elements_received(dist.get_rank()) * 4)
    rollout.shutdown()
    return out


# --- the engine: a merged sync, and an adapter loaded from memory --------------------

# Every target but up_proj, and a random B: the adapter moves every kind of layer.
ENGINE_LORA = dict(lora_rank=4, lora_alpha=8.0,
                   lora_target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                        "down_proj"))


def _randomize_b(module, seed: int) -> None:  # noqa: ANN001
    """Every lora_B of a (sharded) trainer model set to a random tensor (each rank
    its rows), so the adapters change the model visibly (B starts at zero)."""
    from hybrid_engine.parallel.params import local_rows, sharded_named_parameters

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sharded_named_parameters(module):
            if ".lora_B." in name:
                full = torch.randn(p.shape, generator=g) * 0.05
                r0, r1 = local_rows(p)
                (p.to_local() if hasattr(p, "to_local") else p).copy_(full[r0:r1])


def _merged_model(path: str, module):  # noqa: ANN001, ANN202
    """A transformers model holding W0 + (alpha / r) B A of the trainer's weights."""
    from transformers import AutoModelForCausalLM

    from hybrid_engine.parallel.lora import merged_parameters
    from hybrid_engine.parallel.params import full_tensor, sharded_named_parameters

    merged = {n: full_tensor(p).detach()
              for n, p in merged_parameters(module, sharded_named_parameters(module))}
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ref.load_state_dict(merged, strict=False)
    return ref


def _scored_diff(rollout, sampled) -> float:  # noqa: ANN001
    """Largest gap between the log-probs vLLM sampled with and those it scores."""
    prompts = [sampled.prompt_ids[i // sampled.num_samples] for i in range(len(sampled.token_ids))]
    scored = rollout.score([p + t for p, t in zip(prompts, sampled.token_ids)],
                           [len(p) for p in prompts])
    return max(abs(a - b) for s, lp in zip(scored, sampled.logprobs) for a, b in zip(s, lp))


def _adapter_sync(root: str) -> dict:
    """A LoRA trainer (2 ranks, full sharding) synced into a TP=2 engine by
    sync.lora=adapter, verified, for two adapter versions in turn (the second
    replaces the first); the engine's memory released and restored in between
    with memory.emulate_gpu_sleep, which an engine serving adapters survives."""
    import torch.distributed as dist

    from hybrid_engine.config import MemoryConfig, ModelConfig, RolloutConfig, SyncConfig
    from hybrid_engine.rollout.engine import VLLMRollout
    from hybrid_engine.roles.sync import WeightSync
    from tests.roles.test_sync import _greedy, _max_logprob_diff

    path = _model(root)
    module = start_run(path, {"micro_batch_size": 2}, vocab=VOCAB,
                       model_kw=ENGINE_LORA).trainer.module
    rollout = VLLMRollout(path, RolloutConfig(tensor_parallel_size=2, max_model_len=64,
                                              max_tokens=8, enforce_eager=True),
                          memory=MemoryConfig(kv_cache_gib=0.5, emulate_gpu_sleep=True),
                          dtype="float32", lora_rank=ENGINE_LORA["lora_rank"])
    sync = WeightSync(module.config, SyncConfig(lora="adapter", verify=True, bucket_mb=0.01),
                      tp=2, wire_dtype=torch.float32, adapter=ModelConfig(**ENGINE_LORA))
    base, out = _greedy(rollout, 8), {"rank": dist.get_rank()}
    base_model = _merged_model(path, module)  # B = 0: the base itself
    for version in (1, 2):
        _randomize_b(module, version)
        stats = sync.sync(module, rollout)
        sampled, ref = _greedy(rollout, 8), _merged_model(path, module)
        rollout.release_memory()
        rollout.restore_memory()
        out[version] = dict(sampled=_max_logprob_diff(ref, sampled),
                            scored=_scored_diff(rollout, sampled),
                            base_gap=_max_logprob_diff(base_model, sampled),
                            changed=sampled.token_ids != base.token_ids,
                            kept=rollout.weights_valid and _greedy(rollout, 8) == sampled,
                            bytes=stats["sync_bytes_received"])
    rollout.shutdown()
    return out


@pytest.mark.vllm
@pytest.mark.slow
def test_merged_lora_sync_is_exact_and_never_accumulates(tmp_path) -> None:
    for o in run_ranks(_merge_sync, 2, str(tmp_path), timeout=420):
        assert o["changed"] and o["repeat"], o
        assert o["max_diff"] < 1e-5, o
        assert o["bytes"] == [o["min_bytes"]] * 2, o


@pytest.mark.vllm
@pytest.mark.slow
def test_the_adapter_sync_gives_the_merged_models_logprobs(tmp_path) -> None:
    """sync.lora=adapter into a TP=2 engine (one engine per launch: its shutdown
    ends the process group): vLLM's fp32 log-probs of sampled and of scored
    tokens equal a transformers forward of the merged model, for each adapter
    version (far from the base's); each rank received the adapter's minimum."""
    from transformers import AutoConfig

    lora = LoraDims(ENGINE_LORA["lora_rank"], ENGINE_LORA["lora_target_modules"])
    for case in run_ranks(_adapter_sync, 2, str(tmp_path), timeout=420):
        dims = model_dims(AutoConfig.from_pretrained(f"{tmp_path}/qwen2_lora"))
        want = 4.0 * min_elements(dims, lora, 2, 2, 2, case["rank"])
        for version in (1, 2):
            o = case[version]
            assert o["changed"] and o["kept"] and o["base_gap"] > 1e-2, (version, o)
            assert o["sampled"] < 1e-5 and o["scored"] < 1e-5, (version, o)
            assert o["bytes"] == want > 0, (version, o)


def test_the_adapter_sync_verify_catches_a_wrong_transfer(tmp_path, monkeypatch) -> None:
    """In one process (TP 1): the verified adapter sync passes, and fails naming the
    adapters once the transfer leaves the buffers as they were (zeros)."""
    from transformers import AutoModelForCausalLM

    from hybrid_engine.config import ModelConfig, SyncConfig
    from hybrid_engine.models.tiny import TinyModelSpec, write_tiny_model
    from hybrid_engine.parallel.lora import add_adapters, init_adapters
    from hybrid_engine.reshard.transfer import TransferStats
    from hybrid_engine.roles.sync import WeightSync

    path = write_tiny_model(tmp_path / "m", TinyModelSpec(arch="qwen2", vocab_size=VOCAB))
    model = add_adapters(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
                         ModelConfig(**ENGINE_LORA), torch.float32)
    init_adapters(model)
    _randomize_b(model, 0)
    sync = WeightSync(model.config, SyncConfig(lora="adapter", verify=True), tp=1,
                      wire_dtype=torch.float32, adapter=ModelConfig(**ENGINE_LORA))
    assert sync.sync(model, None)["sync_bytes_received"] == 0  # one rank holds it all
    buffers = sync.adapter_buffers()
    assert torch.equal(buffers["model.layers.0.mlp.down_proj.lora_B.weight"],
                       model.model.layers[0].mlp.down_proj.lora_B["default"].weight)
    for t in buffers.values():
        t.zero_()
    monkeypatch.setattr(sync.executor, "run", lambda *a, **k: TransferStats())
    with pytest.raises(RuntimeError, match=r"adapter sync verify failed on rank 0: \['model"):
        sync.sync(model, None)
