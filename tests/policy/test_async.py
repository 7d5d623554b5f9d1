"""Generation ahead of training (`async_rollout.max_staleness`).

References: the colocated run with the same k, where the phases take turns in
one thread (the separate run overlaps them in a generation thread and must
sample and train exactly the same); an uninterrupted run (resume, with the
batch generated ahead restored from the checkpoint); the engine's own output
before a commit (the double buffer)."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import pytest

from hybrid_engine.config import RunConfig, apply_overrides
from hybrid_engine.metrics import staleness_metrics
from hybrid_engine.policy.ahead import Inflight, SerialWorker, batches_to_json, timed
from hybrid_engine.testing import run_in_subprocess
from hybrid_engine.trajectory import Trajectory, trajectory_from_json, trajectory_to_json
from tests.fakes import FakeAlgorithm, FakeEnv, FakePolicy
from tests.policy.runs import assert_rows_close
from tests.policy.runs import rows as _rows
from tests.policy.runs import stable as _stable
from tests.policy.runs import train

# --- units ------------------------------------------------------------------------


def test_staleness_metrics_count_each_samples_version() -> None:
    trajs = [Trajectory(prompt_ids=[1], response_ids=[2], rollout_logp=[0.0], policy_version=v)
             for v in (5, 4, 4, 3)]
    m = staleness_metrics(trajs, 5, 2)
    assert m == {"staleness_mean": 1.0, "staleness_max": 2.0, "staleness/0": 0.25,
                 "staleness/1": 0.5, "staleness/2": 0.25}
    assert staleness_metrics(trajs[:1], 5, 0) == {"staleness_mean": 0.0, "staleness_max": 0.0}


def test_max_staleness_needs_an_importance_correction() -> None:
    with pytest.raises(ValueError, match="behaviour_logp=rollout.*rollout_correction"):
        apply_overrides(RunConfig(), {"async_rollout.max_staleness": 1})
    for extra in ({"algorithm.behaviour_logp": "rollout"}, {"algorithm.tis_cap": 2.0},
                  {"algorithm.rollout_correction": "icepop"}):
        cfg = apply_overrides(RunConfig(), {"async_rollout.max_staleness": 1, **extra})
        assert cfg.async_rollout.max_staleness == 1
    with pytest.raises(ValueError, match="max_staleness"):
        apply_overrides(RunConfig(), {"async_rollout.max_staleness": -1})


def test_trajectory_json_round_trip_is_exact() -> None:
    import torch

    t = Trajectory(prompt_ids=[3, 4], response_ids=[5, 6, 7],
                   rollout_logp=torch.tensor([-0.1, -2.5, -1e-7], dtype=torch.float64).tolist(),
                   loss_mask=[True, False, True], group_id=2, policy_version=9,
                   info={"source_prompt_ids": [1, 2]})
    back = trajectory_from_json(json.loads(json.dumps(trajectory_to_json(t))))
    assert back == t


def test_inflight_shares_the_result_once_and_raises_a_failure_everywhere() -> None:
    """One broadcast of the source's batch, cached; a failure anywhere (gathered from
    every rank first) raises on every rank instead."""
    pool, shared = SerialWorker("test"), []

    def share(obj):  # noqa: ANN001, ANN202 -- one rank: the source's object is its own
        shared.append(obj)
        return obj

    gate = threading.Event()
    h = Inflight(pool.submit(lambda: timed(lambda: (gate.wait(5), [1, 2])[1])), share)
    assert pool.busy
    gate.set()
    assert h.result()[0] == [1, 2] and h.result()[0] == [1, 2]
    assert len(shared) == 1 and not pool.busy  # one broadcast, cached after
    bad = Inflight(pool.submit(lambda: timed(lambda: 1 / 0)), share)
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        bad.result()
    # Any rank's failure raises on every rank, whether it generates (here: its batch
    # is fine) or not, and whether the failed rank is the source of share() or not.
    for future in (None, pool.submit(lambda: timed(lambda: [3]))):
        other_failed = Inflight(future, share, lambda err: [err, "ValueError: boom"])
        with pytest.raises(RuntimeError, match="ValueError: boom"):
            other_failed.result()
    assert len(shared) == 1  # nothing shared once a failure is known
    pool.shutdown()


def test_drain_waits_for_every_job_in_order() -> None:
    pool, order = SerialWorker("test"), []
    for i in range(3):
        pool.submit(lambda i=i: (threading.Event().wait(0.05), order.append(i)))
    pool.drain()
    assert order == [0, 1, 2] and not pool.busy
    pool.shutdown()


def test_metrics_sink_writes_the_staleness_histogram(tmp_path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from hybrid_engine.metrics import MetricsSink

    sink = MetricsSink(tmp_path)
    sink.write(1, {"staleness/0": 0.25, "staleness/1": 0.75})
    sink.close()
    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"histograms": 0})
    acc.Reload()
    (event,) = acc.Histograms("staleness")
    assert event.step == 1 and list(event.histogram_value.bucket) == [0.25, 0.75]


# --- the engine's double buffer ----------------------------------------------------

PROMPTS = [[1, 2, 3, 4], [5, 6, 7]]


def _double_buffer(model_dir: str) -> dict:
    """A sync's writes land in back buffers: generation is unchanged until
    commit_weights(), then it samples the written weights."""
    import torch

    from hybrid_engine.config import MemoryConfig, RolloutConfig
    from transformers import AutoConfig

    from hybrid_engine.reshard.layouts import model_dims
    from hybrid_engine.reshard.plan import build_plan
    from hybrid_engine.rollout.engine import VLLMRollout

    cfg = RolloutConfig(tensor_parallel_size=1, num_samples_per_prompt=2, max_tokens=8,
                        max_model_len=64, enforce_eager=True)
    rollout = VLLMRollout(model_dir, cfg, memory=MemoryConfig(kv_cache_gib=0.05), dtype="float32",
                          double_buffer=True)
    first = rollout.generate(PROMPTS, seed=3)
    shapes = {t.name: t.shape for t in build_plan(model_dims(AutoConfig.from_pretrained(model_dir)), 1, 1)
              .targets[0]}
    live = {p.data_ptr() for p in rollout._model().parameters()}
    targets = rollout.weight_targets(shapes)
    aliased = [n for n, t in targets.items() if t.data_ptr() in live]
    for t in targets.values():
        t.copy_(torch.randn_like(t))
    rollout.install_staged()  # a group's install: deferred with the double buffer
    before_commit = rollout.generate(PROMPTS, seed=3)
    rollout.commit_weights()
    after = rollout.generate(PROMPTS, seed=3)
    rollout.shutdown()
    return {"aliased": aliased, "unchanged": before_commit.token_ids == first.token_ids
            and before_commit.logprobs == first.logprobs,
            "changed": after.logprobs != first.logprobs,
            "back_bytes": rollout.staging_bytes,
            "model_bytes": sum(t.numel() * t.element_size() for t in targets.values())}


@pytest.mark.vllm
@pytest.mark.slow
def test_double_buffer_installs_only_at_commit(tmp_path) -> None:
    from hybrid_engine.models.tiny import PRESETS, write_tiny_model

    model_dir = str(write_tiny_model(tmp_path / "m", PRESETS["tiny"]))
    out = run_in_subprocess(_double_buffer, model_dir, timeout=240)
    assert out["aliased"] == []  # no target is a live parameter
    assert out["unchanged"] and out["changed"], out
    assert out["back_bytes"] == out["model_bytes"]  # one whole second copy


# --- whole runs under torchrun ------------------------------------------------------


def _train(model: Path, reward: Path, out: Path, nproc: int, *extra: str):  # noqa: ANN202
    return train(model, reward, out, nproc, "--rollout.tensor_parallel_size=1",
                 "--algorithm.behaviour_logp=rollout", *extra)


@pytest.mark.vllm
@pytest.mark.slow
def test_separate_ahead_equals_colocated_ahead_and_resumes(model_dir, reward_file,
                                                           tmp_path) -> None:
    """k = 1: 1 trainer + 1 rollout rank (generation thread, double buffer; the
    sync behind the next step on its own thread, or, verified, in the step) vs
    1 colocated rank (phases in turn, GPU sleep emulated): the same samples,
    versions and updates; step 1 trains on step 0's weights' batch (staleness
    0), later steps on the previous step's (staleness 1); a resume from step
    2's checkpoint restores the batch generated ahead and repeats step 3."""
    sep, col, sync = tmp_path / "separate", tmp_path / "colocated", tmp_path / "k0"
    verified = tmp_path / "verified"
    separate = ("--placement=separate", "--rollout.num_ranks=1", "--async_rollout.max_staleness=1")
    _train(model_dir, reward_file, sep, 2, *separate, "--sync.verify=false")
    _train(model_dir, reward_file, verified, 2, *separate, "--sync.verify=true")
    # 4 of the 16 sequences re-scored for the mismatch split (mismatch_split_sequences)
    # the colocated twin on the separate run's schedule (auto: colocated bursts)
    _train(model_dir, reward_file, col, 1, "--async_rollout.max_staleness=1",
           "--async_rollout.schedule=stream", "--guards.mismatch_split_sequences=4")
    _train(model_dir, reward_file, sync, 1)
    rows = _rows(sep)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert all(r["skipped_degenerate"] == 0.0 for r in rows[1:])  # every step trained
    assert_rows_close(rows, _rows(col))
    assert_rows_close(_rows(verified), rows)
    # behind: each step reports the previous step's sync (none before step 2)
    assert [r.get("sync_behind") for r in rows[1:]] == [1.0, 1.0, 1.0]
    assert "sync_bytes_received" not in rows[1] and rows[2]["sync_bytes_received"] > 0
    assert "sync_behind" not in _rows(verified)[2]
    assert [r["staleness_max"] for r in rows[1:]] == [0.0, 1.0, 1.0]
    assert [r["staleness/1"] for r in rows[1:]] == [0.0, 1.0, 1.0]
    assert all(r["generate_busy_s"] > 0 for r in rows[1:])
    # Colocated, the drift scorer splits the mismatch: fp32 numerics stay ~1e-6 while
    # the batch one update old drifts (the total is drift + numerics: on the sample
    # of 4 sequences the drift estimates the total over all 16).
    c = _rows(col)
    assert all(c[s]["mismatch_numerics_abs_mean"] < 1e-4 for s in (1, 2, 3))
    assert c[1]["mismatch_drift_abs_mean"] < 1e-4  # staleness 0: nothing to drift
    for s in (2, 3):
        assert c[s]["mismatch_drift_abs_mean"] > 100 * c[s]["mismatch_numerics_abs_mean"]
        assert 0.5 < c[s]["mismatch_drift_abs_mean"] / c[s]["mismatch_abs_mean"] < 2
    # ... measured on the scorer's sample: a quarter of the sequences (<= 8 tokens each);
    # step 1's batch is fresh (no sync since it was sampled): all of it, with no prefill
    for s in (2, 3):
        assert 0 < c[s]["mismatch_split_tokens"] <= 4 * 8 < 16 * c[s]["response_len_mean"]
    assert c[1]["mismatch_split_tokens"] == c[1]["num_tokens"]
    assert c[1]["mismatch_drift_abs_mean"] == 0.0
    assert "mismatch_drift_abs_mean" not in rows[2]  # separate: no drift scorer
    # The knob acts: k = 0 trains step 2 on a batch of step 1's weights, so its
    # ratio to the behaviour (rollout) policy is 1 up to fp32 noise; k = 1's batch
    # came from step 0's weights, one update away.
    k0 = _rows(sync)
    assert [r["staleness_max"] for r in k0[1:]] == [0.0, 0.0, 0.0]
    assert _stable(k0[1]) == {k: v for k, v in _stable(rows[1]).items()
                              if not k.startswith("staleness/")}
    for step in (2, 3):
        assert abs(k0[step]["ratio_max"] - 1) < 1e-3 < abs(rows[step]["ratio_max"] - 1)
    ckpt = json.loads(sorted((sep / "checkpoints").glob("*/meta.json"))[-1].read_text())
    (ahead,) = ckpt["extra"]["ahead"]
    assert ahead["version"] == 1 and len(ahead["trajs"]) == 16
    _train(model_dir, reward_file, sep, 2, *separate, "--sync.verify=false", "--resume")
    resumed = _rows(sep)
    assert [r["step"] for r in resumed] == [0, 1, 2, 3]
    assert _stable(resumed[-1]) == _stable(rows[-1])


@pytest.mark.vllm
@pytest.mark.slow
def test_max_staleness_2_runs_two_batches_ahead(model_dir, reward_file, tmp_path) -> None:
    """k = 2, colocated, one rank. Stream: steps 1-2 train batches of the initial
    weights, later steps batches sampled two updates earlier (the knob's depth
    acts). Burst (auto, colocated): one pass samples steps 1-3's batches with the
    initial weights (staleness 0, 1, 2) and step 4 starts the next pass (of one
    batch: none past the last step); a resume
    from step 2's checkpoint restores the burst's last batch and repeats steps 3-4."""
    stream, burst = tmp_path / "stream", tmp_path / "burst"
    _train(model_dir, reward_file, stream, 1, "--async_rollout.max_staleness=2",
           "--async_rollout.schedule=stream", "--train.num_steps=4")
    rows = [r for r in _rows(stream) if "staleness_max" in r]  # training steps, not evals
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["staleness_max"] for r in rows] == [0.0, 1.0, 2.0, 2.0]
    assert [r["staleness/2"] for r in rows] == [0.0, 0.0, 1.0, 1.0]
    assert all(r["generate_busy_s"] > 0 for r in rows)  # a generation every step
    burst_run = ("--async_rollout.max_staleness=2", "--train.num_steps=4", "--keep_checkpoints=2")
    _train(model_dir, reward_file, burst, 1, *burst_run)
    rows = [r for r in _rows(burst) if "staleness_max" in r]
    assert [r["staleness_max"] for r in rows] == [0.0, 1.0, 2.0, 0.0]
    assert [r["staleness/1"] for r in rows] == [0.0, 1.0, 0.0, 0.0]
    # the pass runs in steps 1 and 4; steps 2-3 only take their batch from the queue
    assert all(rows[i]["generate_s"] < 0.1 * min(rows[0]["generate_s"], rows[3]["generate_s"])
               for i in (1, 2))
    # the pass's engine seconds shared by tokens: each step's tokens per second is the pass's
    assert rows[0]["gen_tok_s"] == pytest.approx(rows[1]["gen_tok_s"], rel=1e-6)
    assert rows[1]["gen_tok_s"] == pytest.approx(rows[2]["gen_tok_s"], rel=1e-6)
    assert [r["samples"] for r in rows] == [16.0] * 4  # 4 prompts x K 4 each step
    from hybrid_engine.checkpoint import step_checkpoints

    (_, at2), (_, at4) = step_checkpoints(burst / "checkpoints")
    metas = [json.loads((p / "meta.json").read_text())["extra"]["ahead"] for p in (at2, at4)]
    # what each pass left: step 4's pass sampled only its own batch (the run's last step)
    assert [[b["version"] for b in m] for m in metas] == [[0], []]
    assert sorted({t["group_id"] for t in metas[0][0]["trajs"]}) == [0, 1, 2, 3]
    shutil.rmtree(at4)  # resume from step 2: step 3 trains the restored batch
    _train(model_dir, reward_file, burst, 1, *burst_run, "--resume")
    resumed = [r for r in _rows(burst) if "staleness_max" in r]
    assert [_stable(r) for r in resumed[2:]] == [_stable(r) for r in rows[2:]]


@pytest.mark.vllm
@pytest.mark.slow
def test_stale_samples_are_corrected_against_the_weights_that_sampled_them(
        model_dir, reward_file, tmp_path) -> None:
    """k = 2 with a rollout correction (icepop) instead of behaviour_logp=rollout:
    the ratio old / rollout is 1 (to fp32 noise) on a fresh batch and spreads out
    on batches sampled one and two updates earlier."""
    out = tmp_path / "icepop"
    train(model_dir, reward_file, out, 1, "--rollout.tensor_parallel_size=1",
          "--async_rollout.max_staleness=2", "--async_rollout.schedule=stream",
          "--algorithm.rollout_correction=icepop", "--train.num_steps=3")
    rows = [r for r in _rows(out) if "staleness_max" in r]
    assert [r["staleness_max"] for r in rows] == [0.0, 1.0, 2.0]
    spread = [r["correction/ratio_p90"] - r["correction/ratio_p10"] for r in rows]
    assert spread[0] < 1e-3 < spread[1] and spread[2] > 1e-3, rows
    assert all(0.0 <= r["correction/clipped_frac"] <= 1.0 and r["rollout_kl"] >= 0
               for r in rows)


def _controller(**overrides):  # noqa: ANN202
    from hybrid_engine.controller import Controller

    class Env:  # the controller only restores the env's state here
        def state_dict(self) -> dict:
            return {}

        def load_state_dict(self, d: dict) -> None:
            pass

    cfg = apply_overrides(RunConfig(), {"async_rollout.max_staleness": 2,
                                        "algorithm.behaviour_logp": "rollout",
                                        "train.prompts_per_step": 1,
                                        "rollout.num_samples_per_prompt": 1, **overrides})
    return Controller(None, Env(), None, cfg)


def _saved(*versions: int) -> dict:
    """A checkpoint at step 4 holding batches ahead of these versions."""
    batch = {"generate_s": 0.1, "trajs": [trajectory_to_json(
        Trajectory(prompt_ids=[1], response_ids=[2], rollout_logp=[-0.5]))]}
    return {"step": 4, "reward_ema": 0.5, "wall_s": 1.0, "history": [], "env": {},
            "ahead": [{**batch, "version": v} for v in versions]}


def test_a_resume_with_another_depth_discards_the_batches_ahead(caplog) -> None:
    """A checkpoint's batches ahead are restored when this run may train them:
    none past its bound, at most k queued (stream refills the rest with the
    restored weights), each of its batch size; else discarded with a warning
    that says their prompts are skipped. Nothing to restore: no warning."""
    import logging

    c = _controller(**{"async_rollout.schedule": "stream"})
    with caplog.at_level(logging.WARNING):
        c.load_state_dict(_saved())  # e.g. a k = 0 run's checkpoint
        assert not c._ahead and not caplog.text
        c.load_state_dict(_saved(3))  # saved at k = 1: one batch, trains at staleness 1
        assert [v for v, _ in c._ahead] == [3] and not caplog.text
        c.load_state_dict(_saved(3, 4))
        assert [v for v, _ in c._ahead] == [3, 4]
        c.load_state_dict(_saved(2, 2))  # step 5 would train the second at staleness 3
        assert not c._ahead and "discarded; their prompts are skipped" in caplog.text
    bigger = _controller(**{"async_rollout.schedule": "stream", "train.prompts_per_step": 2})
    bigger.load_state_dict(_saved(3, 4))  # batches of 1 trajectory; this run's are 2
    assert not bigger._ahead


def test_the_controllers_state_carries_the_guards_streak() -> None:
    """The checkpointed controller state holds the non-finite streak, so a resumed
    run's guards go on from it (tests/test_guards.py: the abort step matches)."""
    c = _controller()
    c.guards.nonfinite_in_a_row = 2
    state = json.loads(json.dumps(c.state_dict()))
    resumed = _controller()
    resumed.load_state_dict(state)
    assert resumed.guards.nonfinite_in_a_row == 2


@pytest.mark.parametrize(("versions", "kept"), [
    ((3,), True), ((3, 3), True), ((), True),  # a burst's rest: any count up to k
    ((1,), False),  # step 4 would train a version-1 batch: staleness 3 > 2
    ((2, 2), False),  # step 5 would train the second at staleness 3
    ((2, 2, 2), False),  # more than k batches
])
def test_a_burst_resume_keeps_the_batches_within_the_bound(caplog, versions, kept) -> None:
    """Burst (colocated's auto): the queue holds what is left of the last pass, from
    none to k batches; restored if every one trains within max_staleness."""
    c = _controller()  # colocated: auto = burst
    assert c.cfg.ahead_burst()
    c.load_state_dict(_saved(*versions))
    assert [v for v, _ in c._ahead] == (list(versions) if kept else [])


def test_split_burst_gives_each_batch_its_groups_and_its_share_of_the_seconds() -> None:
    from hybrid_engine.policy.ahead import split_burst

    # 3 batches x 2 prompts x K 2; prompt p's completions have p + 1 tokens; the env's
    # group ids are ignored (99): a batch's groups are its prompts, by position
    trajs = [Trajectory(prompt_ids=[p], response_ids=[j] * (p + 1), rollout_logp=[-1.0] * (p + 1),
                        group_id=99) for p in range(6) for j in range(2)]
    handles = split_burst(trajs, 4.2, 3, 2, 2)
    batches = [h.result() for h in handles]
    assert [[t.prompt_ids[0] for t in b] for b, _ in batches] == [[0, 0, 1, 1], [2, 2, 3, 3],
                                                                  [4, 4, 5, 5]]
    assert all([t.group_id for t in b] == [0, 0, 1, 1] for b, _ in batches)
    # 6, 14 and 22 of the pass's 42 tokens: every step's tokens per second is the pass's
    assert [sec for _, sec in batches] == pytest.approx([0.6, 1.4, 2.2])
    with pytest.raises(ValueError, match="returned 11"):
        split_burst(trajs[:11], 1.0, 3, 2, 2)


def test_ahead_schedule_auto_bursts_colocated_and_streams_separate() -> None:
    base = {"async_rollout.max_staleness": 1, "algorithm.behaviour_logp": "rollout"}
    assert apply_overrides(RunConfig(), base).ahead_burst()
    assert not apply_overrides(RunConfig(), {**base, "placement": "separate"}).ahead_burst()
    assert apply_overrides(RunConfig(), {**base, "placement": "separate",
                                         "async_rollout.schedule": "burst"}).ahead_burst()
    assert not apply_overrides(RunConfig(), {**base, "async_rollout.schedule": "stream"}
                               ).ahead_burst()
    with pytest.raises(ValueError, match="nothing runs ahead"):
        apply_overrides(RunConfig(), {**base, "async_rollout.partial": True,
                                      "async_rollout.step_token_budget": 64,
                                      "async_rollout.schedule": "burst"})


# --- the controller's schedules, with recording fakes (no engine) --------------------


class _Stop(Exception):
    pass


def _fake_run(schedule: str, steps: int, state: dict | None = None,  # noqa: ANN202
              stop_after: int | None = None):
    from hybrid_engine.controller import Controller

    def record(step: int, m: dict) -> None:
        rows.append(m)
        if step == stop_after:
            raise _Stop  # as a killed run: the controller's state is step stop_after's

    cfg = apply_overrides(RunConfig(), {
        "async_rollout.max_staleness": 2, "algorithm.behaviour_logp": "rollout",
        "async_rollout.schedule": schedule, "rollout.num_samples_per_prompt": 2,
        "train.prompts_per_step": 3, "train.num_steps": steps, "eval.at_start": False, "eval.at_end": False,
        "checkpoint_every": 0})
    policy, rows = FakePolicy(), []
    c = Controller(policy, FakeEnv(), FakeAlgorithm(), cfg, on_metrics=record)
    if state is not None:
        c.load_state_dict(state)
        policy.version = state["step"]
    try:
        c.run(handle_signals=False)
    except _Stop:
        pass
    return c, policy, rows


def test_burst_samples_k_plus_1_batches_per_pass_and_resumes_mid_burst() -> None:
    """k = 2, 3 prompts x K 2 per step: a pass of 9 prompts at steps 0 and 3 (each
    step's prompts in order, the step's seed), staleness 0, 1, 2, 0, ...; a refill
    round runs at once with the current weights; the last pass samples no batch
    past the last step; a resume from the controller's state after step 4 (one
    batch left of the second pass) repeats steps 5-6."""
    c, policy, rows = _fake_run("burst", 7)
    passes = [(len(p), seed % 1_000_003, v) for p, seed, v in policy.passes]
    # bursts at steps 0, 3 (9 prompts) and 6 (3: the run ends after it); refills of 1
    # prompt at steps 2 and 5
    assert [(n, v) for n, _, v in passes] == [(9, 0), (1, 2), (9, 3), (1, 5), (3, 6)]
    assert policy.passes[0][0] == list(range(9))  # steps 0-2's prompts, in order
    assert [r["staleness_max"] for r in rows] == [0.0, 1.0, 2.0, 0.0, 1.0, 2.0, 0.0]
    assert [r["samples"] for r in rows] == [6, 6, 8, 6, 6, 8, 6]  # + the refill's 2
    assert all(r["gen_tok_s"] < 1e6 for r in rows)  # every batch has its share of seconds
    # state after step 4 (of 0-6), as a checkpoint holds it, then a resumed run to step 7
    c5, _, _ = _fake_run("burst", 7, stop_after=5)
    state = json.loads(json.dumps({**c5.state_dict(), "ahead": batches_to_json(c5._ahead)}))
    assert state["step"] == 5 and [b["version"] for b in state["ahead"]] == [3]
    _, resumed_policy, resumed = _fake_run("burst", 7, state)
    assert [_stable(r) for r in resumed[-2:]] == [_stable(r) for r in rows[-2:]]
    assert resumed_policy.passes[-1][0] == policy.passes[-1][0]  # the same prompts


def test_stream_starts_one_batch_per_step_k_ahead() -> None:
    """Stream, k = 2: steps 0-2's batches at step 0, then one batch per step for the
    step 2 ahead (with that step's weights); the refill at step 2 at once."""
    _, policy, rows = _fake_run("stream", 5)
    assert [(len(p), v) for p, _, v in policy.passes] == [
        (3, 0), (3, 0), (3, 0), (3, 1), (3, 2), (1, 2), (3, 3), (3, 4)]
    assert [r["staleness_max"] for r in rows] == [0.0, 1.0, 2.0, 2.0, 2.0]


def test_the_generations_metrics_are_read_every_step_trained_or_not() -> None:
    """`policy.rollout_metrics()` (partial rollouts' counts since the last call) is
    read after each step's sampling, so a step that trains nothing still reports
    its own generation, and gen_tok_s divides the engine's sampled tokens (not
    the trained samples' tokens, parked prefixes included) by its seconds."""
    from hybrid_engine.controller import Controller

    class Policy(FakePolicy):
        def rollout_metrics(self) -> dict:
            return {"partial/sampled_tokens": 10.0 * len(self.passes)}

    class NothingToTrain(FakeAlgorithm):
        def select(self, trajs):  # noqa: ANN001, ANN201
            return []

    cfg = apply_overrides(RunConfig(), {"rollout.num_samples_per_prompt": 2,
                                        "train.prompts_per_step": 3, "train.num_steps": 2,
                                        "eval.at_start": False, "eval.at_end": False, "checkpoint_every": 0})
    rows = []
    c = Controller(Policy(), FakeEnv(), NothingToTrain(), cfg,
                   on_metrics=lambda s, m: rows.append(m))
    c.run(handle_signals=False)
    assert [r["skipped_degenerate"] for r in rows] == [1.0, 1.0]
    assert [r["partial/sampled_tokens"] for r in rows] == [10.0, 20.0]
    assert rows[0]["gen_tok_s"] == 10.0 / rows[0]["generate_s"]


def test_cancel_queued_leaves_the_running_job_and_drops_the_rest() -> None:
    """Shutdown's first move (separate placement): batches ahead that have not
    started are cancelled, so a sync's install waiting on them (`wait`) ends when
    the running one does."""
    from concurrent.futures import wait

    pool, gate, started = SerialWorker("test"), threading.Event(), threading.Event()
    running = pool.submit(lambda: (started.set(), gate.wait(5))[1])
    queued = pool.submit(lambda: 1)
    started.wait(5)
    pool.cancel_queued()
    gate.set()
    wait(pool.pending())
    assert running.result() is True and queued.cancelled()
    pool.shutdown()
