"""The controller: first its loop on recording fakes (call order, the skip of a step
with nothing to train, eval and checkpoint cadence, each stop reason; no engine),
then end to end on real ranks: vLLM rollout, FSDP2 training, resharded sync
(verified bit for bit every step), for 1/2/4 ranks and every algorithm family;
checkpoint + resume reproduces the uninterrupted run step for step."""

from __future__ import annotations

import math
import zlib

import pytest

from hybrid_engine.envs import ENVS, register_env
from hybrid_engine.envs.arithmetic import ArithmeticEnv
from hybrid_engine.envs.base import decode
from hybrid_engine.testing import run_ranks
from tests.fakes import FakeAlgorithm, FakeEnv, FakePolicy


def _e2e(fn):  # noqa: ANN001, ANN202
    """Marks an end-to-end test: real ranks, a vLLM engine, tens of seconds."""
    return pytest.mark.vllm(pytest.mark.slow(fn))


# Keys that measure time or memory: they differ between runs by nature.
_VOLATILE = ("_s", "_bytes")


# --- the loop on recording fakes (no engine) -----------------------------------------


class _Logged:
    """The fakes' calls in order, as (role.method[, step]) names."""

    def __init__(self) -> None:
        self.calls: list[str] = []


def _fakes(log: _Logged, *, flat_steps=(), train_metrics=None, clock=None):  # noqa: ANN001, ANN202
    """A policy, env, scorer, learner and algorithm that log every call. A step in
    flat_steps (1-based) draws only flat groups: the algorithm selects nothing.
    clock: a one-element list the policy's layout switches advance (1 s to
    training, 0.5 s to inference)."""

    class Policy(FakePolicy):
        def collect(self, env, prompts, *, num_samples, seed, sampling=None):  # noqa: ANN001, ANN201
            log.calls.append("policy.eval" if sampling else "policy.collect")
            return super().collect(env, prompts, num_samples=num_samples, seed=seed)

        def train_step(self, trajs, loss_fn=None) -> dict:  # noqa: ANN001
            log.calls.append("policy.train_step")
            super().train_step(trajs, loss_fn)
            return dict(train_metrics(self.version) if train_metrics else {})

        def sync_weights(self) -> dict:
            log.calls.append("policy.sync_weights")
            return {}

        def switch_to(self, layout) -> None:  # noqa: ANN001
            log.calls.append(f"policy.switch_to {layout}")
            if clock is not None:
                clock[0] += 1.0 if layout == "training" else 0.5

    class Env(FakeEnv):
        def score(self, trajs) -> None:  # noqa: ANN001
            log.calls.append("env.score")
            super().score(trajs)

    class Role:
        layout = "training"  # the controller switches before its calls

        def score(self, trajs) -> None:  # noqa: ANN001, ARG002
            log.calls.append("scorer.score")

        def train_step(self, trajs) -> dict:  # noqa: ANN001, ARG002
            log.calls.append("learner.train_step")
            return {}

    class Algorithm(FakeAlgorithm):
        def __init__(self) -> None:
            self.steps = 0

        def compute_advantages(self, trajs) -> dict:  # noqa: ANN001
            log.calls.append("algorithm.advantages")
            self.steps += 1
            for t in trajs:
                t.advantages = [1.0] * len(t.response_ids)
            return {}

        def prompts_wanted(self, trajs, rounds: int) -> int:  # noqa: ANN001, ARG002
            return 0

        def select(self, trajs):  # noqa: ANN001, ANN201
            log.calls.append("algorithm.select")
            return [] if self.steps in flat_steps else trajs

    return Policy(), Env(), Role(), Algorithm()


def _fast_run(overrides: dict, *, flat_steps=(), train_metrics=None,  # noqa: ANN001, ANN202
              handle_signals=False, clock=None):
    """Runs a Controller on the fakes; returns (log, summary or the exception, rows)."""
    from hybrid_engine.config import RunConfig, apply_overrides
    from hybrid_engine.controller import Controller

    cfg = apply_overrides(RunConfig(), {
        "rollout.num_samples_per_prompt": 2, "train.prompts_per_step": 2,
        "train.num_steps": 3, "eval.at_start": False, "eval.at_end": False, "checkpoint_every": 0,
        "eval.num_prompts": 3, **overrides})
    log, rows = _Logged(), []
    policy, env, role, algorithm = _fakes(log, flat_steps=flat_steps, train_metrics=train_metrics,
                                          clock=clock)

    class Checkpointer:
        def save(self, step: int, extra: dict) -> None:
            assert extra["step"] == step
            log.calls.append(f"save {step}")

    def on_metrics(step: int, m: dict) -> None:
        log.calls.append(f"metrics {step}")
        rows.append({"step": step, **m})

    def on_samples(step: int, trajs: list) -> None:
        log.calls.append(f"samples {step} ({len(trajs)} with advantages)"
                         if all(t.advantages is not None for t in trajs) else "samples early")

    c = Controller(policy, env, algorithm, cfg, scorers=[role], learners=[role],
                   checkpointer=Checkpointer(), on_metrics=on_metrics, on_samples=on_samples)
    try:
        return log, c.run(handle_signals=handle_signals), rows
    except Exception as e:  # noqa: BLE001 -- the caller checks which
        return log, e, rows


def _sample(step: int) -> list[str]:
    return ["policy.switch_to inference", "policy.collect",
            "policy.switch_to training", "scorer.score", "env.score", "algorithm.advantages",
            f"samples {step} (4 with advantages)", "algorithm.select"]


def _step(step: int) -> list[str]:
    return [*_sample(step), "policy.switch_to training", "policy.train_step",
            "learner.train_step", "policy.sync_weights"]


def test_a_step_calls_the_roles_in_order() -> None:
    """... and hands each step's samples, advantages set, to on_samples."""
    log, summary, rows = _fast_run({"train.num_steps": 2})
    assert log.calls == [*_step(1), "metrics 1", *_step(2), "metrics 2"]
    assert summary["steps"] == 2 and summary["stop_reason"] == "num_steps"
    assert [r["train_samples"] for r in rows] == [4.0, 4.0]
    assert [h["step"] for h in summary["history"]] == [1, 2]


def test_layout_switches_are_timed_apart_from_the_phases(monkeypatch) -> None:
    """The release before a trainer-side scorer counts in switch_s, not score_s:
    per step, to inference (0.5 s), to training for the scorer and again
    before the train step (1 s each), on a clock only the switches advance."""
    import types

    from hybrid_engine import metrics

    clock = [0.0]
    monkeypatch.setattr(metrics, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    _, _, rows = _fast_run({"train.num_steps": 2}, clock=clock)
    assert [(r["switch_s"], r["score_s"], r["train_s"]) for r in rows] == [(2.5, 0.0, 0.0)] * 2


def test_a_step_with_nothing_to_train_skips_train_and_sync() -> None:
    log, summary, rows = _fast_run({"train.num_steps": 3}, flat_steps=(2,))
    assert log.calls == [*_step(1), "metrics 1", *_sample(2), "metrics 2", *_step(3), "metrics 3"]
    assert [r["skipped_degenerate"] for r in rows] == [0.0, 1.0, 0.0]
    assert [r["train_samples"] for r in rows] == [4.0, 0.0, 4.0]
    assert "train_s" not in rows[1] and "sync_s" not in rows[1]


@pytest.mark.parametrize(("every", "at_start", "at_end", "steps"), [
    (2, False, False, [2, 4]), (0, True, False, [0]), (0, False, True, [5]), (5, False, True, [5])])
def test_eval_cadence_knobs(every, at_start, at_end, steps) -> None:
    """eval.every, eval.at_start and eval.at_end each decide evaluations (the end's
    is skipped when the last step just evaluated)."""
    _, _, rows = _fast_run({"train.num_steps": 5, "eval.every": every,
                            "eval.at_start": at_start, "eval.at_end": at_end})
    assert [r["step"] for r in rows if "eval/reward_mean" in r] == steps


def test_eval_and_checkpoint_cadence() -> None:
    """eval.every=2 over 5 steps: at step 0, 2, 4 and after the last; a checkpoint
    every 2 steps, none for the unfinished period (a signal saves it instead)."""
    log, summary, rows = _fast_run({"train.num_steps": 5, "eval.every": 2, "eval.at_start": True,
                                    "eval.at_end": True, "checkpoint_every": 2})
    events = [c for c in log.calls if c.startswith(("policy.eval", "save", "metrics"))]
    assert events == ["policy.eval", "metrics 0", "metrics 1", "policy.eval", "metrics 2",
                      "save 2", "metrics 3", "policy.eval", "metrics 4", "save 4", "metrics 5",
                      "policy.eval", "metrics 5"]
    evals = [r["step"] for r in rows if "eval/reward_mean" in r]
    assert evals == [0, 2, 4, 5] and summary["steps"] == 5


def test_a_final_evaluation_that_fails_saves_the_last_step_first(monkeypatch) -> None:
    """Bad input found only by the evaluation after the last step (a reward that
    raises on its prompts): the last step, not on the checkpoint cadence, is saved
    before the error, so the training is not lost (the job then exports final/)."""
    from hybrid_engine.controller import Controller, FinalEvaluationFailed

    def fails(self) -> dict:  # noqa: ANN001
        raise ValueError("asked for 64 evaluation problems, found only 7")

    monkeypatch.setattr(Controller, "evaluate", fails)
    log, error, _ = _fast_run({"train.num_steps": 3, "eval.at_end": True, "checkpoint_every": 2})
    assert isinstance(error, FinalEvaluationFailed) and "found only 7" in str(error)
    assert [c for c in log.calls if c.startswith("save")] == ["save 2", "save 3"]


def test_stop_on_target_reward_ema() -> None:
    # FakeEnv's reward is the prompt's parity: step 1's mean is 0.5, the EMA's first value
    _, summary, _ = _fast_run({"train.num_steps": 10, "target_reward_ema": 0.5})
    assert (summary["steps"], summary["stop_reason"]) == (1, "target_reward_ema")
    _, summary, _ = _fast_run({"train.num_steps": 4, "target_reward_ema": 0.6})
    assert (summary["steps"], summary["stop_reason"]) == (4, "num_steps")


def test_stop_on_max_wall_s(monkeypatch) -> None:
    """A clock that moves 10 s per train step: max_wall_s=25 stops after step 3."""
    import types

    from hybrid_engine import controller

    now = [0.0]
    monkeypatch.setattr(controller, "time", types.SimpleNamespace(monotonic=lambda: now[0]))

    def ten_seconds(version: int) -> dict:
        now[0] += 10.0
        return {}

    _, summary, _ = _fast_run({"train.num_steps": 10, "max_wall_s": 25.0},
                              train_metrics=ten_seconds)
    assert (summary["steps"], summary["stop_reason"]) == (3, "max_wall_s")
    assert summary["wall_s"] == 30.0


def test_stop_on_a_signal_finishes_the_step_and_saves() -> None:
    import os
    import signal

    def signal_at_step_2(version: int) -> dict:
        if version == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return {}

    from hybrid_engine.parallel import signals

    try:
        log, summary, _ = _fast_run({"train.num_steps": 10, "checkpoint_every": 5},
                                    train_metrics=signal_at_step_2, handle_signals=True)
    finally:
        signals.reset()  # the request outlives the run: later runs in this process start clean
    assert (summary["steps"], summary["stop_reason"]) == (2, "signal")
    assert log.calls[-3:] == ["policy.sync_weights", "metrics 2", "save 2"]


def test_a_guard_aborts_after_writing_the_steps_metrics_before_its_checkpoint() -> None:
    from hybrid_engine.guards import RunAborted

    def nonfinite_from_step_2(version: int) -> dict:
        bad = version >= 2
        return {"skipped": float(bad), "optimizer_steps": float(not bad),
                "grad_norm": float("nan") if bad else 1.0}

    log, error, rows = _fast_run({"train.num_steps": 10, "checkpoint_every": 1,
                                  "guards.max_nonfinite_in_a_row": 2},
                                 train_metrics=nonfinite_from_step_2)
    assert isinstance(error, RunAborted) and "2 steps in a row" in str(error)
    assert [r["nonfinite_in_a_row"] for r in rows] == [0.0, 1.0, 2.0]
    assert [c for c in log.calls if c.startswith("save")] == ["save 1", "save 2"]
    assert log.calls[-1] == "metrics 3"


# --- end to end on real ranks ---------------------------------------------------------


class DigitEnv(ArithmeticEnv):
    """Arithmetic prompts with a shaped reward a random-init model already varies on:
    the fraction of digits among the first 8 response characters (plus exact match)."""

    name = "test_digits"

    def _reward(self, traj, prompt_text):  # noqa: ANN001, ANN202
        text = decode(self.tokenizer, traj.response_ids)[:8]
        digits = sum(c.isdigit() for c in text) / 8
        return {**super()._reward(traj, prompt_text), "digits": digits}


class HalfFlatEnv(DigitEnv):
    """DigitEnv whose reward is 0 for every sample of about half the prompts (CRC32
    parity of the prompt): flat groups on demand, for dynamic sampling's refill."""

    name = "test_half_flat"

    def _reward(self, traj, prompt_text):  # noqa: ANN001, ANN202
        reward = super()._reward(traj, prompt_text)
        if zlib.crc32(prompt_text.encode()) % 2:
            return {k: 0.0 for k in reward}
        return reward


def _register_digits() -> None:
    """Registers the test envs in this (rank) process only, so the registry seen by
    other tests in the pytest process stays the product's."""
    for name, cls in (("test_digits", DigitEnv), ("test_half_flat", HalfFlatEnv)):
        if name not in ENVS:
            register_env(name)(lambda cfg, tokenizer, cls=cls: cls(tokenizer, seed=cfg.seed))


def _config(model_dir: str, out_dir: str, overrides: dict):
    from hybrid_engine.config import apply_overrides
    from hybrid_engine.config.recipes import get_recipe

    base = {
        "model.path": model_dir, "output_dir": out_dir, "env.name": "test_digits",
        "rollout.num_samples_per_prompt": 4, "rollout.max_tokens": 8, "train.num_steps": 2,
        "train.prompts_per_step": 4, "train.lr": 1e-3, "checkpoint_every": 0,
        "eval.num_prompts": 4, "memory.emulate_gpu_sleep": True,
        "model.compute_dtype": "float32",  # with the recipe's fp32 rollout: the same policy
        "memory.release": "true",  # every phase: the emulation acts every step
    }
    return apply_overrides(get_recipe("tiny_grpo_debug"), {**base, **overrides})


def _fake_tp_costs(bound: str) -> None:
    """rollout.tensor_parallel_size=auto's calibration runs (on the real ranks, its
    figures checked), then reports a machine whose decode is all-reduce bound (TP 1
    wins) or weight-read bound (TP 2 wins)."""
    from hybrid_engine.parallel import rollout_tp

    real = rollout_tp.calibrate

    def fake(cfg, dims, sizes, group):  # noqa: ANN001, ANN202
        fake.calls += 1
        costs = real(cfg, dims, sizes, group)
        assert sorted(costs.read) == [1, 2] and sorted(costs.allreduce) == [1, 2], costs
        assert all(0 < costs.read[t] < 1 for t in sizes) and 0 < costs.allreduce[2] < 1, costs
        if bound == "allreduce":
            return rollout_tp.Costs({1: 1e-3, 2: 5e-4}, {1: 0.0, 2: 1e-3})
        return rollout_tp.Costs({1: 1e-3, 2: 5e-4}, {1: 0.0, 2: 1e-6})

    fake.calls = 0
    rollout_tp.calibrate = fake


def _run_job(model_dir: str, out_dir: str, overrides: dict, resume: bool = False) -> dict:
    """The job's summary (overrides["cpu_without_bf16"]: this rank process reports a
    CPU with neither AVX512-BF16 nor AMX to every `auto` dtype; overrides["tp_costs"]:
    `_fake_tp_costs`; overrides["eager_is_faster"]: model.attention=auto's rule says
    eager whatever the device and dtype)."""
    import torch

    from hybrid_engine.job import Job

    _register_digits()
    overrides = dict(overrides)
    if overrides.pop("cpu_without_bf16", False):
        torch.cpu._is_avx512_bf16_supported = lambda: False
        torch.cpu._is_amx_tile_supported = lambda: False
    if "tp_costs" in overrides:
        _fake_tp_costs(overrides.pop("tp_costs"))
    if overrides.pop("eager_is_faster", False):
        from hybrid_engine.parallel import precision

        precision.eager_is_faster = lambda *_: True
    job = Job(_config(model_dir, out_dir, overrides), resume=resume, progress=False)
    try:
        def local(p):  # noqa: ANN001, ANN202  (a shard, or a replica's whole tensor)
            return p.to_local() if hasattr(p, "to_local") else p

        before = {n: local(p).detach().clone()
                  for n, p in job.actor.trainer.state_dict_shards().items()}
        summary = job.run()
        after = job.actor.trainer.state_dict_shards()
        changed = max(float((local(after[n]) - before[n]).abs().max()) for n in before)
        summary["max_weight_change"] = changed
        summary["critic"] = job.critic is not None
        summary["rollout_dtype"] = job.actor.rollout.facts["dtype"]  # as vLLM holds the weights
        summary["rollout_tp"] = job.actor.rollout.facts["tensor_parallel_size"]  # vLLM's own
        from hybrid_engine.parallel import rollout_tp

        summary["tp_calibrations"] = getattr(rollout_tp.calibrate, "calls", None)
        tp_group = job.actor.trainer.tp_group  # train.tensor_parallel_size's TP group
        summary["train_tp"] = 1 if tp_group is None else torch.distributed.get_world_size(tp_group)
        from hybrid_engine.roles.mirrored import Mirrored

        refs = [role.reference for s in job.controller.scorers if isinstance(s, Mirrored)
                for role in (m.role for m in s.members) if type(role).__name__ == "ReferenceScorer"]
        summary["reference"] = bool(refs)
        summary["attention"] = {  # transformers' attention each trained or scoring role runs
            name: module.config._attn_implementation for name, module in (
                ("trainer", job.actor.trainer.module), *(("reference", r.module) for r in refs),
                *((("critic", job.critic.module.model),) if job.critic else ()))}
    finally:
        job.shutdown()
    assert torch.isfinite(torch.tensor([h.get("loss", 0.0) for h in summary["history"]])).all()
    return summary


def _check_trained(summary: dict, steps: int) -> None:
    hist = [h for h in summary["history"] if h["step"] > 0]
    assert len(hist) == steps and summary["stop_reason"] == "num_steps"
    trained = [h for h in hist if not h["skipped_degenerate"]]
    assert trained, "every step was degenerate: the test env should give varied rewards"
    for h in trained:
        assert math.isfinite(h["loss"]) and math.isfinite(h["grad_norm"])
        assert h["sync_s"] > 0
        # fp32 rollout + fp32 trainer on the synced weights: the same policy.
        assert h["mismatch_abs_max"] < 1e-3, h["mismatch_abs_max"]
    assert summary["max_weight_change"] > 0
    previous = 0.0
    for h in hist:  # generated tokens: each sample's sampled tokens once, per generate second
        assert h["generated_tokens"] == pytest.approx(h["samples"] * h["response_len_mean"])
        assert h["gen_tok_s"] == pytest.approx(h["generated_tokens"] / h["generate_s"])
        phases = sum(h.get(f"{p}_s", 0.0) for p in ("generate", "score", "train", "sync"))
        assert h["elapsed_s"] - previous >= phases  # the step's wall clock holds its phases
        previous = h["elapsed_s"]


# Optimizer state parked between steps (memory.offload_optimizer): eval, checkpoints
# and a resume around a parked state must not change a single metric.
_STRAIGHT = {"rollout.tensor_parallel_size": 2, "checkpoint_every": 2, "keep_checkpoints": 2,
             "eval.every": 2, "eval.at_start": True, "train.num_steps": 4,
             "memory.offload_optimizer": True}


def _resume_from_step(run_dir, step: int, tmp_path):  # noqa: ANN001, ANN202
    """A copy of a finished run's folder without its checkpoints past `step`: what
    a run stopped after that step leaves."""
    import shutil

    from hybrid_engine.checkpoint import step_checkpoints

    copy = tmp_path / "resumed"
    shutil.copytree(run_dir, copy)
    kept = step_checkpoints(copy / "checkpoints")
    assert step in [n for n, _ in kept], kept
    for n, path in kept:
        if n > step:
            shutil.rmtree(path)
    return str(copy)


@pytest.fixture(scope="module")
def straight(model_dir, tmp_path_factory):  # noqa: ANN201
    """One 4-step run on 2 ranks (TP 2), with an eval and a checkpoint every 2
    steps: every rank's summary and the run's folder. The 2-rank case below and the
    resume test's reference."""
    from types import SimpleNamespace

    out = tmp_path_factory.mktemp("straight") / "run"
    return SimpleNamespace(ranks=run_ranks(_run_job, 2, model_dir, str(out), _STRAIGHT,
                                           timeout=400), dir=out)


@_e2e
@pytest.mark.parametrize(("world", "tp", "arch"), [(1, 1, "qwen2"), (2, 2, "qwen2"),
                                                   (4, 2, "qwen2"), (2, "auto", "mistral"),
                                                   (2, 2, "phi3"), (2, 2, "gemma"), (2, 2, "gemma2"),
                                                   (2, 2, "qwen3_moe"), (2, 1, "mixtral"),
                                                   (2, "auto", "granite")])
def test_grpo_runs_on_1_2_4_ranks(model_dir, tmp_path, world, tp, arch, request) -> None:
    """(mistral: sliding window 8, shorter than the prompts and completions; phi3:
    fused qkv_proj and gate_up_proj; gemma: Gemma 3, window 8 on every other layer;
    gemma2: the same without q/k norms, its attention and logits soft-capped;
    qwen3_moe and mixtral: 6 experts, top 2, sharded 3 / 3 by FSDP2; granite: Llama's
    tensors under its four multipliers. 4 ranks: the policy trains with TP 2 inside,
    FSDP2 across, train.tensor_parallel_size=2. 1 rank: model.rollout_dtype=auto on a
    CPU reported without bf16 instructions: the engine holds fp32 weights, and the
    mismatch check would catch bf16 ones. rollout.tensor_parallel_size=auto: the
    calibration runs on both ranks, then reports an all-reduce bound machine for
    mistral (vLLM then runs TP 1) and a weight-read bound one for granite (TP 2).)"""
    if arch != "qwen2":
        from hybrid_engine.models.tiny import TinyModelSpec, write_tiny_model

        window = {"sliding_window": 8} if arch in ("mistral", "gemma", "gemma2") else {}
        if arch == "gemma2":  # tied, as Gemma 2 always is; caps small enough to bite
            window.update(tie_word_embeddings=True, attn_softcap=5.0, final_softcap=3.0)
        model_dir = str(write_tiny_model(tmp_path / "m", TinyModelSpec(arch=arch, **window)))
    if world == 2 and arch == "qwen2":
        out, steps = request.getfixturevalue("straight").ranks, _STRAIGHT["train.num_steps"]
    else:
        extra = {4: {"train.tensor_parallel_size": 2},
                 1: {"model.rollout_dtype": "auto", "cpu_without_bf16": True}}.get(world, {})
        if tp == "auto":
            extra["tp_costs"] = "allreduce" if arch == "mistral" else "read"
        out, steps = run_ranks(_run_job, world, model_dir, str(tmp_path / "run"),
                               {"rollout.tensor_parallel_size": tp, **extra}, timeout=400), 2
    _check_trained(out[0], steps)
    assert out[0]["train_tp"] == (2 if world == 4 else 1)
    assert out[0]["rollout_dtype"] == "float32"
    assert out[0]["rollout_tp"] == {"auto": 1 if arch == "mistral" else 2}.get(tp, tp)
    assert out[0]["tp_calibrations"] == (1 if tp == "auto" else None)
    # Every rank saw the same rewards and took the same decisions.
    keys = ("reward_mean", "loss", "skipped_degenerate")
    for r in out[1:]:
        assert [[h.get(k) for k in keys] for h in r["history"]] == \
               [[h.get(k) for k in keys] for h in out[0]["history"]]


@_e2e
@pytest.mark.parametrize("algo", ["drgrpo", "rloo", "ppo"])
def test_algorithms_on_2_ranks(model_dir, tmp_path, algo) -> None:
    """(DAPO: test_dapo_clips_refills_and_resumes.) PPO with GAE takes 2 epochs, so
    its critic's second update sees moved values and the value clip binds."""
    overrides = {
        "drgrpo": {"algorithm.advantage": "drgrpo", "algorithm.loss_agg": "constant"},
        "rloo": {"algorithm.advantage": "rloo", "algorithm.kl_coef": 0.05,
                 "eager_is_faster": True},
        "ppo": {"algorithm.advantage": "gae", "algorithm.gamma": 1.0, "algorithm.lam": 0.95,
                "train.ppo_epochs": 2, "model.attention": "eager"},
    }[algo]
    out = run_ranks(_run_job, 2, model_dir, str(tmp_path / "run"), overrides, timeout=400)
    _check_trained(out[0], 2)
    assert out[0]["critic"] == (algo == "ppo")
    assert out[0]["reference"] == (algo == "rloo")
    # Every role runs the trainer's attention: model.attention=eager (ppo), or auto's
    # choice, made eager here by its rule (rloo), else sdpa (fp32 compute).
    roles = {"rloo": ("trainer", "reference"), "ppo": ("trainer", "critic")}.get(algo, ("trainer",))
    assert out[0]["attention"] == dict.fromkeys(roles, "sdpa" if algo == "drgrpo" else "eager")
    trained = [h for h in out[0]["history"] if h["step"] > 0 and not h["skipped_degenerate"]]
    if algo == "ppo":
        assert all(math.isfinite(h["critic/vf_loss"]) for h in trained)
        assert all(h["critic/optimizer_steps"] == 2 and h["optimizer_steps"] == 2
                   for h in trained)
        assert any(h["critic/vf_clip_frac"] > 0 for h in trained), \
            [h["critic/vf_clip_frac"] for h in trained]
    if algo == "rloo":
        assert all("kl" in h for h in trained)


def _comparable(history: list[dict]) -> list[dict]:
    return [{k: v for k, v in h.items() if not k.endswith(_VOLATILE)} for h in history]


@_e2e
def test_resume_reproduces_the_straight_run(model_dir, straight, tmp_path) -> None:
    """The straight run parks its optimizer state between steps and emulates GPU
    sleep (each release overwrites vLLM's weights with NaN). A run that never
    releases nor parks anything gives the same metrics (no phase ever sampled
    discarded weights), and a resume from the straight run's step-2 checkpoint
    (saved with the state parked) repeats steps 3-4."""
    k = 2
    ref = straight.ranks[0]
    resident = run_ranks(_run_job, 2, model_dir, str(tmp_path / "r"),
                         {**_STRAIGHT, "memory.offload_optimizer": False,
                          "memory.release": False, "memory.emulate_gpu_sleep": False},
                         timeout=400)[0]
    assert _comparable(ref["history"]) == _comparable(resident["history"])
    assert not any("offload_moved_bytes" in h for h in resident["history"])
    resumed = run_ranks(_run_job, 2, model_dir, _resume_from_step(straight.dir, k, tmp_path),
                        _STRAIGHT, True, timeout=400)[0]
    a, b = _comparable(ref["history"]), _comparable(resumed["history"])
    assert [h["step"] for h in b] == [0, *range(1, 2 * k + 1)]
    assert a == b
    assert any(not h["skipped_degenerate"] for h in a if h["step"] > k)
    parked = [h["offload_moved_bytes"] for h in resumed["history"]
              if h["step"] > 1 and "offload_moved_bytes" in h]
    assert parked and all(m > 0 for m in parked)


@_e2e
def test_dapo_clips_refills_and_resumes(model_dir, tmp_path) -> None:
    """DAPO (clip-higher 0.28, 2 mini-batches, dynamic sampling) on an env whose
    groups are flat for about half the prompts: the clip binds on some step, a step
    whose first draw had a flat group draws again, and a resume from the run's
    step-2 checkpoint repeats its steps 3-4 (the refilled prompt stream included)."""
    k = 2
    common = {"env.name": "test_half_flat", "rollout.tensor_parallel_size": 2,
              "algorithm.clip_high": 0.28, "algorithm.dynamic_sampling": True,
              "algorithm.max_sampling_rounds": 3, "algorithm.overlong_buffer": 4,
              "train.mini_batches_per_rollout": 2, "checkpoint_every": k, "keep_checkpoints": 2}
    straight = run_ranks(_run_job, 2, model_dir, str(tmp_path / "a"),
                         {**common, "train.num_steps": 2 * k}, timeout=400)[0]
    _check_trained(straight, 2 * k)
    hist = [h for h in straight["history"] if h["step"] > 0]
    trained = [h for h in hist if not h["skipped_degenerate"]]
    assert any(h["clip_frac"] > 0 for h in trained), [h["clip_frac"] for h in trained]
    assert all(h["optimizer_steps"] == 2 for h in trained)
    refilled = [h for h in hist if h["sampling_rounds"] > 1]
    assert refilled and all(h["groups_flat"] >= 1 for h in refilled), \
        [(h["sampling_rounds"], h["groups_flat"]) for h in hist]
    # Never more than prompts_per_step groups (of K = 4 samples) train.
    assert all(h["train_samples"] <= 4 * 4 for h in hist)
    resumed = run_ranks(_run_job, 2, model_dir, _resume_from_step(tmp_path / "a", k, tmp_path),
                        {**common, "train.num_steps": 2 * k}, True, timeout=400)[0]
    assert _comparable(straight["history"]) == _comparable(resumed["history"])


def _run_with_layer0_unsynced(model_dir: str, out_dir: str, overrides: dict) -> dict:
    """A deliberately broken sync: layer 0's weights never reach vLLM (they are
    written into scratch tensors instead), everything else syncs normally."""
    import torch

    from hybrid_engine.job import Job

    _register_digits()
    job = Job(_config(model_dir, out_dir, overrides), progress=False)
    rollout = job.actor.rollout
    real = rollout.weight_targets

    def weight_targets(shapes):  # noqa: ANN001, ANN202
        skip = {n: s for n, s in shapes.items() if ".layers.0." in n}
        out = real({n: s for n, s in shapes.items() if n not in skip})
        return {**out, **{n: torch.empty(s, dtype=job.actor.syncer.wire_dtype) for n, s in skip.items()}}

    rollout.weight_targets = weight_targets
    asked = []  # per generate call: which requests asked vLLM for log-probs, and how
    generate = rollout.llm.generate

    def recording_generate(requests, params, **kwargs):  # noqa: ANN001, ANN003, ANN202
        if params and params[0].top_k != 1:  # the step's samples, not greedy evaluation
            asked.append([(p.logprobs, p.flat_logprobs) for p in params])
        return generate(requests, params, **kwargs)

    rollout.llm.generate = recording_generate
    try:
        job.run()
        return {"error": None}
    except RuntimeError as e:
        return {"error": str(e), "history": job.controller.state.history, "asked": asked}
    finally:
        job.shutdown()


@_e2e
@pytest.mark.parametrize("emulate", [False, True])
def test_broken_sync_trips_the_mismatch_alarm(model_dir, tmp_path, emulate) -> None:
    """Without emulation the stale layer 0 trips the mismatch alarm; with GPU sleep
    emulated its weights are NaN after the first release, and the engine refuses to
    return NaN samples at the next generate, before any alarm."""
    overrides = {"rollout.tensor_parallel_size": 2, "train.num_steps": 4, "train.lr": 1e-2,
                 "sync.verify": False, "guards.mismatch_alarm": 1e-3,
                 "guards.mismatch_abort": True, "memory.emulate_gpu_sleep": emulate,
                 "memory.release": "true"}
    out = run_ranks(_run_with_layer0_unsynced, 2, model_dir, str(tmp_path / "run"), overrides,
                    timeout=400)
    expected = "NaN log-probs" if emulate else "log-prob mismatch"
    for r in out:  # every rank stops, with the same message
        assert r["error"] is not None and expected in r["error"], r
    assert out[0]["error"] == out[1]["error"]
    if not emulate:  # the alarm's step is recorded, flagged, then the run stops
        assert out[0]["history"][-1]["mismatch_alarm"] == 1.0
        # One update per rollout, no staleness: vLLM returned log-probs (flat) only
        # for the mismatch sample, the first completion of each group (K = 4).
        for call in out[0]["asked"]:
            assert call and call == [(0 if j % 4 == 0 else None, True)
                                     for j in range(len(call))], call
        assert all(0 < h["mismatch_tokens"] < h["num_tokens"] for h in out[0]["history"]
                   if h["step"] > 0 and not h["skipped_degenerate"])
    # The steps before the alarm were healthy: fp32 sync gives ~1e-6.
    trained = [h for h in out[0]["history"] if h["step"] > 0 and not h["skipped_degenerate"]
               and "mismatch_alarm" not in h]
    assert trained and all(h["mismatch_abs_mean"] < 1e-3 for h in trained)


def _reward_model_job(model_dir: str, out_dir: str, rm_path: str) -> dict:
    from hybrid_engine.job import Job

    _register_digits()
    job = Job(_config(model_dir, out_dir, {"env.reward_model_path": rm_path,
                                           "train.num_steps": 1, "eval.at_start": True,
                                           "eval.at_end": True,
                                           "rollout.tensor_parallel_size": 1}),
              progress=False)
    layouts = []
    score = job.env.score

    def recording(trajs):  # noqa: ANN001, ANN202
        layouts.append(job.actor.phases.layout)
        return score(trajs)

    job.env.score = recording
    try:
        summary = job.run()
    finally:
        job.shutdown()
    return {"layouts": layouts, "steps": summary["steps"]}


@_e2e
def test_reward_model_scores_in_the_training_layout(model_dir, tmp_path) -> None:
    """The reward model's forwards run with the engine released (the training
    layout), like the reference's: the controller switches to the layout the
    env names."""
    from hybrid_engine.envs.reward_model import write_tiny_reward_model
    from hybrid_engine.models.tiny import TinyModelSpec

    rm = write_tiny_reward_model(tmp_path / "rm", TinyModelSpec(seed=3))
    out = run_ranks(_reward_model_job, 1, model_dir, str(tmp_path / "run"), str(rm),
                    timeout=300)[0]
    # eval at step 0, the step's scoring, eval after it: every call in the training layout
    assert out["steps"] == 1 and out["layouts"] == ["training"] * 3, out
