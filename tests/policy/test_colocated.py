"""HybridActor on 2 real ranks, with GPU sleep emulated (memory.emulate_gpu_sleep: a
release overwrites vLLM's weights with NaN, as level-2 sleep discards them): the two
layouts agree, the memory switch happens (KV cache released, optimizer state parked in
host memory while vLLM generates), every way into the training layout (`training()`,
`compute_logprobs`, `train_step`, a save or load of a parked state) is followed by a
generate that resyncs by itself and never samples the discarded weights, save/load keep
the layout they found, and save/load restore the policy and its optimizer state even
while that state is parked. A last case removes one invalidation by hand (sampling
weights a release discarded) and the emulation makes it fail loudly."""

from __future__ import annotations

import pytest

from hybrid_engine.testing import run_ranks

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PROMPTS = ["12+35=", "7+8=", "40+2="]


def _max_diff(a, b) -> float:
    import torch

    return max(float((torch.as_tensor(x) - torch.as_tensor(y)).abs().max()) for x, y in zip(a, b))


def _parked(actor) -> bool:
    """The optimizer has state and every storage of it is empty (offloaded)."""
    from hybrid_engine.parallel.offload import optimizer_state_storages

    state = actor.trainer.optimizer.state
    return (actor.offload.offloaded and len(state) > 0
            and not optimizer_state_storages(actor.trainer.optimizer, actor.trainer.device))


def _resident(actor) -> bool:
    """The optimizer has state, all of it on the device (not offloaded)."""
    import torch

    from hybrid_engine.parallel.offload import optimizer_state_storages

    storages = optimizer_state_storages(actor.trainer.optimizer, actor.trainer.device)
    return not actor.offload.offloaded and len(storages) > 0 and all(
        t.untyped_storage().nbytes() > 0 for st in actor.trainer.optimizer.state.values()
        for t in st.values() if isinstance(t, torch.Tensor))


def _actor_case(model_dir: str, ckpt: str) -> dict:
    from hybrid_engine.policy.colocated import HybridActor, completions_to_trajectories
    from hybrid_engine.parallel.dist import collective_timeouts

    host = collective_timeouts()  # the host's (run_ranks') default group
    actor = HybridActor.from_pretrained(model_dir, overrides={"collective_timeout_s": 123,
        "rollout.tensor_parallel_size": 2, "rollout.max_tokens": 6, "rollout.max_model_len": 64,
        "memory.kv_cache_gib": 0.25, "rollout.enforce_eager": True, "train.lr": 1e-2,
        "model.compute_dtype": "float32", "model.rollout_dtype": "float32",
        "memory.offload_optimizer": True, "memory.emulate_gpu_sleep": True,
        "memory.release": "true"})
    try:
        timeouts = collective_timeouts()
        out = {"host_kept": all(timeouts[name] == t for name, t in host.items()),
               "own_groups": {t for name, t in timeouts.items() if name not in host}}
        trajs = completions_to_trajectories(actor.generate(PROMPTS, num_samples=2, seed=1))
        # The trainer's log-probs of vLLM's samples = vLLM's own (same weights, fp32).
        out["layouts_agree"] = _max_diff(actor.compute_logprobs(trajs),
                                         [t.rollout_logp for t in trajs])
        # A trainer forward runs in the training layout: the engine released (and,
        # emulated, lost) its weights; the next generate resyncs them.
        out["logprobs_phase"] = (actor.phase, actor.phases.weights)
        again = completions_to_trajectories(actor.generate(PROMPTS, num_samples=2, seed=1))
        out["resynced_same_samples"] = [t.response_ids for t in again] == \
            [t.response_ids for t in trajs]

        # The controller's explicit switches: the engine's weights go with its
        # memory (emulated) and come back resynced.
        actor.switch_to("inference")
        actor.switch_to("training")
        out["switch_to"] = [(actor.phase, actor.phases.weights)]
        actor.switch_to("inference")
        out["switch_to"].append((actor.phase, actor.phases.weights))
        actor.save(ckpt)
        # DCP created the AdamW state on the device beside the awake engine: parked.
        out["parked_after_first_save"] = _parked(actor) and actor.phase == "inference"
        before = actor.compute_logprobs(trajs)
        for i, t in enumerate(trajs):
            t.advantages = [1.0 if i % 2 else -1.0] * len(t.response_ids)
        with actor.training():
            out["phase_in_training"] = actor.phase
            m = actor.train_step(trajs)
        out["released"] = m["mem_released_bytes"]
        after = actor.compute_logprobs(trajs)
        out["train_moved"] = _max_diff(after, before)
        # No explicit sync_weights(): generate must sync (and regrow the KV cache) itself.
        trajs2 = completions_to_trajectories(actor.generate(PROMPTS, num_samples=2, seed=2))
        out["phase_after_generate"] = actor.phase
        out["parked_while_generating"] = _parked(actor) and all(
            p.grad is None for p in actor.trainer.module.parameters())
        out["fresh_after_generate"] = _max_diff(actor.compute_logprobs(trajs2),
                                                [t.rollout_logp for t in trajs2])
        # Save while parked (the state comes back through the training layout, and
        # the layout goes back after), train, sync (parks the state), reload, train
        # again: the same step twice, so the saved AdamW state was the real one.
        actor.generate(PROMPTS[:1], num_samples=1)  # inference, state parked
        actor.save(f"{ckpt}_trained")
        out["after_parked_save"] = (actor.phase, _parked(actor), actor.phases.weights)
        actor.generate(PROMPTS[:1], num_samples=1)  # the resynced engine samples
        for t in trajs2:
            t.advantages = [1.0] * len(t.response_ids)
        first = actor.train_step(trajs2)
        out["offload_metrics"] = (first["offload_moved_bytes"], first["offload_released_bytes"])
        actor.sync_weights()
        out["parked_after_sync"] = _parked(actor) and actor.phase == "training"
        first_logp = actor.compute_logprobs(trajs2)
        actor.load(f"{ckpt}_trained")
        second = actor.train_step(trajs2)
        out["step_repeats"] = (_max_diff(actor.compute_logprobs(trajs2), first_logp),
                               first["loss"] == second["loss"],
                               first["grad_norm"] == second["grad_norm"])
        actor.generate(PROMPTS[:1], num_samples=1)  # park the state again
        actor.load(ckpt)
        out["after_parked_load"] = (actor.phase, _parked(actor), actor.phases.weights)
        out["load_restores"] = _max_diff(actor.compute_logprobs(trajs), before)
        trajs3 = completions_to_trajectories(actor.generate(PROMPTS, num_samples=2, seed=1))
        out["vllm_follows_load"] = [t.response_ids for t in trajs3] == [t.response_ids for t in trajs]
        return out
    finally:
        actor.shutdown()


def test_hybrid_actor_switches_syncs_and_restores(tmp_path) -> None:
    from hybrid_engine.models.tiny import PRESETS, write_tiny_model

    model = write_tiny_model(tmp_path / "m", PRESETS["tiny"])
    out = run_ranks(_actor_case, 2, str(model), str(tmp_path / "ckpt"), timeout=300)
    for r in out:
        # vLLM's and FSDP's groups got the configured timeout; the host's kept its own.
        assert r["own_groups"] == {123.0} and r["host_kept"]
        assert r["layouts_agree"] < 1e-4
        assert r["logprobs_phase"] == ("training", "lost")
        assert r["resynced_same_samples"]        # the resync restored exactly the weights
        assert r["switch_to"] == [("training", "lost"), ("inference", "valid")]
        assert r["phase_in_training"] == "training" and r["released"] > 0
        assert r["train_moved"] > 1e-3
        assert r["phase_after_generate"] == "inference"
        assert r["fresh_after_generate"] < 1e-4  # vLLM sampled from the trained weights
        assert r["parked_after_first_save"] and r["parked_while_generating"]
        # The layout it found (inference), the state parked again; the release on the
        # way discarded vLLM's weights and the way back resynced them.
        assert r["after_parked_save"] == ("inference", True, "valid")
        moved, released = r["offload_metrics"]
        assert moved > 0 and released == 0      # CPU: nothing is claimed as freed
        assert r["parked_after_sync"]
        assert r["step_repeats"] == (0.0, True, True)
        # The same way back: the resync after the release wrote the loaded weights.
        assert r["after_parked_load"] == ("inference", True, "valid")
        assert r["load_restores"] < 1e-6
        assert r["vllm_follows_load"]            # same seed, restored weights: same samples


def _discarded_weights_case(model_dir: str) -> dict:
    """Sampling discarded weights, reintroduced on purpose: the engine's invalidation on release
    is removed (its weights are lost but it claims they are valid), then the public
    `training()` is followed by `generate()` with no train step in between."""
    from hybrid_engine.policy.colocated import HybridActor
    from hybrid_engine.rollout.cpu import CpuBackend

    actor = HybridActor.from_pretrained(model_dir, overrides={
        "rollout.tensor_parallel_size": 2, "rollout.max_tokens": 4, "rollout.max_model_len": 64,
        "memory.kv_cache_gib": 0.25, "rollout.enforce_eager": True,
        "model.rollout_dtype": "float32", "memory.emulate_gpu_sleep": True,
        "memory.release": "true"})
    out = {}
    try:
        actor.generate(PROMPTS, num_samples=1)
        with actor.training():
            pass
        out["changed_after_block"] = actor.phases.trainer_changed  # the block may step
        out["guarded"] = _error(lambda: actor.generate(PROMPTS, num_samples=1))
        release = CpuBackend.release

        def release_but_claim_valid(self, llm):  # noqa: ANN001, ANN202
            freed, _lost = release(self, llm)
            return freed, False  # the invalidation a buggy transition forgets

        CpuBackend.release = release_but_claim_valid
        try:
            actor.phases.to_train()  # the transition alone (training() marks a change)
            out["unguarded"] = _error(lambda: actor.generate(PROMPTS, num_samples=1))
        finally:
            CpuBackend.release = release
        return out
    finally:
        actor.shutdown()


def _error(fn) -> str | None:  # noqa: ANN001
    try:
        fn()
    except RuntimeError as e:
        return str(e)
    return None


def test_emulated_sleep_catches_a_forgotten_invalidation(tmp_path) -> None:
    from hybrid_engine.models.tiny import PRESETS, write_tiny_model

    model = write_tiny_model(tmp_path / "m", PRESETS["tiny"])
    for r in run_ranks(_discarded_weights_case, 2, str(model), timeout=300):
        # Correct bookkeeping: training() then generate() resyncs; nothing raised.
        assert r["guarded"] is None and r["changed_after_block"]
        # Without the invalidation the engine samples the NaN weights: refused, loudly.
        assert r["unguarded"] is not None and "NaN log-probs" in r["unguarded"], r


def _bf16_master_case(model_dir: str) -> dict:
    import torch

    from hybrid_engine.parallel.params import full_tensor
    from hybrid_engine.policy.colocated import HybridActor

    actor = HybridActor.from_pretrained(model_dir, overrides={
        "rollout.max_tokens": 4, "rollout.max_model_len": 64, "memory.kv_cache_gib": 0.25,
        "rollout.enforce_eager": True, "model.rollout_dtype": "float32",
        "model.master_dtype": "bfloat16", "model.compute_dtype": "bfloat16"})
    try:
        actor.generate(PROMPTS, num_samples=1)  # step 0's rollout
        name = "model.embed_tokens.weight"
        engine = dict(actor.rollout._model().named_parameters())[name]
        trainer = full_tensor(dict(actor.trainer.state_dict_shards())[name])
        rows = min(engine.shape[0], trainer.shape[0])
        return {"equal": torch.equal(engine[:rows].float(), trainer[:rows].float())}
    finally:
        actor.shutdown()


def test_bf16_master_rollouts_start_from_the_trainers_rounded_weights(tmp_path) -> None:
    """A bf16 master rounds the fp32 checkpoint; vLLM loaded the file itself. Step 0
    must still sample exactly the trainer's weights."""
    from hybrid_engine.models.tiny import PRESETS, write_tiny_model

    model = write_tiny_model(tmp_path / "m", PRESETS["tiny"])  # fp32 file
    out = run_ranks(_bf16_master_case, 1, str(model), timeout=240)[0]
    assert out["equal"]
