"""Faults under torchrun on 2 ranks: a rank SIGKILLed during rollout, training,
sync or a checkpoint save takes the job down within 10 s with one line naming
it and its phase, leaving nothing in /dev/shm; the newest complete
checkpoint loads, and resuming from it reproduces the uninterrupted run's
per-step metrics, its final evaluation's included (exactly the eval file's
prompts, greedy and k samples each: mean@k, pass@k, maj@k), also with
generation ahead (separate placement: the rollout
rank killed in its generation thread or mid-sync); fixed seeds give identical
runs; resuming refuses another model's checkpoint and --overwrite starts over
in an earlier run's folder (a fresh run's refusal of it: tests/test_preflight.py)."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import shutil
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from hybrid_engine.checkpoint import latest_checkpoint, step_checkpoint_path
from hybrid_engine.testing import processes_mentioning, run_job, run_torchrun

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

STEPS = 4
HERE = Path(__file__).resolve().parent
# The problems: training rows with small operands, evaluation rows with operands
# >= 500, which the reward records, to show evaluation reads exactly that file.
EVAL_ROWS = [f"{500 + 37 * i}+{i}=" for i in range(6)]
EVAL_K = 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from hybrid_engine.models.tiny import PRESETS, write_tiny_model

    folder = write_tiny_model(tmp_path_factory.mktemp("model") / "tiny", PRESETS["tiny"])
    # A random-init model never solves arithmetic: reward a coin flip hashed from
    # the completion instead, so every group carries signal and every step trains,
    # and call a third of the completions "correct" (by another hash), so the
    # evaluation's estimators see both kinds.
    (folder.parent / "reward.py").write_text(
        "import zlib\n\n"
        "def reward(prompt, completion, answer):\n"
        "    if int(prompt.split('+')[0]) >= 500:\n"
        f"        with open({str(folder.parent / 'eval_seen.txt')!r}, 'a') as f:\n"
        "            f.write(prompt + '\\n')\n"
        "    h = zlib.crc32(completion.encode())\n"
        "    return {'coin': float(h % 2), 'correct': float(h % 3 == 0)}\n")
    for name, prompts in (("train", [f"{i}+{j}=" for i in range(8) for j in range(8)]),
                          ("eval", EVAL_ROWS)):
        (folder.parent / f"{name}.jsonl").write_text("".join(
            json.dumps({"prompt": p, "answer": str(sum(map(int, p[:-1].split("+"))))}) + "\n"
            for p in prompts))
    return folder


def _argv(model: Path, out: Path, *extra: str) -> list[str]:
    return ["train", "--recipe=tiny_grpo_debug", "--no-progress",
            f"--model.path={model}", f"--output_dir={out}", "--rollout.max_tokens=8",
            "--sync.verify=false", f"--train.num_steps={STEPS}", "--checkpoint_every=1",
            "--keep_checkpoints=2", "--train.lr=1e-3",
            f"--env.reward_fn={model.parent / 'reward.py'}:reward",
            f"--env.dataset_path={model.parent / 'train.jsonl'}",
            f"--env.eval_dataset_path={model.parent / 'eval.jsonl'}",
            # Evaluated after the last step only: a fault in steps 1-3 meets no evaluation.
            "--eval.at_end=true", "--eval.num_prompts=0", f"--eval.num_samples={EVAL_K}",
            "--eval.samples_file=eval_samples.jsonl", *extra]


def _train(model: Path, out: Path, *extra: str, fault: str | None = None,
           stamp: Path | None = None, master_port: int | None = None,
           launcher: str = "torchrun", nproc: int = 2, fault_rank: int = 1):  # noqa: ANN202
    """The job under torchrun (what a fault meets), fault_rank armed with fault."""
    env = ({"HE_FAULT": fault, "HE_FAULT_RANK": str(fault_rank), "HE_FAULT_STAMP": str(stamp)}
           if fault else {})
    return run_torchrun([str(HERE / "fault_train.py"), *_argv(model, out, *extra)],
                        nproc, timeout=300, env=env, check=False, master_port=master_port,
                        launcher=launcher)


def _run(model: Path, out: Path, *extra: str, nproc: int = 2):  # noqa: ANN202
    """The job without a fault (references, resumes): the same ranks, forked
    instead of started by torchrun (`run_job`)."""
    return run_job(_argv(model, out, *extra), nproc, timeout=300, check=False)


def _steps(out: Path) -> dict[int, dict]:
    """Per-step metrics (a step's and its evaluation's rows merged) without wall
    times and memory (which vary run to run)."""
    steps: dict[int, dict] = {}
    for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()):
        steps.setdefault(r["step"], {}).update(
            {k: v for k, v in r.items() if not (k.endswith("_s") or k.startswith("mem_"))})
    return steps


@pytest.fixture(scope="module")
def reference(model_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("reference") / "run"
    proc = _run(model_dir, out)
    assert proc.returncode == 0, proc.stdout[-3000:]
    return out


def test_the_reference_run_trains_every_step(model_dir, reference) -> None:
    """The straight run every resume is held to. Fixed seeds give identical runs:
    each killed run's steps before the kill are its own, and must equal these."""
    ref = _steps(reference)
    assert sorted(ref) == list(range(1, STEPS + 1))
    assert all(r["skipped_degenerate"] == 0.0 for r in ref.values())  # every step trained
    assert len({r["reward_mean"] for r in ref.values()}) > 1
    # The final weights' evaluation: exactly the eval file's prompts, k samples each.
    last = ref[STEPS]
    assert last["eval/prompts"] == len(EVAL_ROWS)
    seen = model_dir.parent / "eval_seen.txt"
    assert set(seen.read_text().split()) == set(EVAL_ROWS)
    metrics = [f"eval/{m}@{EVAL_K}" for m in ("mean", "pass", "maj")]
    assert all(0.0 <= last[m] <= 1.0 for m in metrics), last
    assert 0.0 < last[f"eval/pass@{EVAL_K}"] and "eval/accuracy" in last
    assert not any(k.startswith("eval/") for s in range(1, STEPS) for k in ref[s])
    # eval.samples_file: that evaluation's every completion once, written by rank 0.
    rows = _eval_rows(reference / "eval_samples.jsonl")
    assert sorted((r["pass"], r["prompt_index"], r["sample"]) for r in rows) == sorted(
        [("greedy", p, 0) for p in range(len(EVAL_ROWS))]
        + [("sampled", p, k) for p in range(len(EVAL_ROWS)) for k in range(EVAL_K)])
    assert {r["step"] for r in rows} == {STEPS}
    assert {r["prompt"] for r in rows} == set(EVAL_ROWS)
    greedy = [r["correct"] for r in rows if r["pass"] == "greedy"]
    assert last["eval/accuracy"] == sum(greedy) / len(greedy)


def _eval_rows(path: Path) -> list[dict]:
    return [json.loads(ln) for ln in path.read_text().splitlines()]


KILL_PHASES = ("rollout", "train", "sync", "save")


def _faulty_runs(model_dir: Path, root: Path, faults: dict[str, str], *extra: str,
                 resume: tuple[str, ...] = (), relaunch: tuple[str, ...] = (),
                 nproc: int = 2, fault_rank: int = 1) -> dict[str, SimpleNamespace]:
    """One job per {name: fault}, two at a time (each mostly waits for its peers to
    notice), the ones named in `resume` resumed after their fault; those also in
    `relaunch` under torchrun on the killed launch's fixed --master_port at once,
    before its shared-memory segments could age. Per name: proc, down_after
    (seconds from the fault to the job's exit; None if the fault never fired), out
    (its folder), latest and tmp_left (its newest complete checkpoint and whether a
    .tmp- folder was left, both before the resume), shm_left (the /dev/shm segments
    made since it started that no process maps once it, and a relaunch, are gone)
    and resumed (the resume's proc)."""
    from concurrent.futures import ThreadPoolExecutor

    from hybrid_engine.testing import free_port

    def run(name: str) -> SimpleNamespace:
        out, stamp = root / name / "run", root / name / "fault_at"
        stamp.parent.mkdir()
        started, port = time.time(), free_port()
        proc = _train(model_dir, out, *extra, fault=faults[name], stamp=stamp, master_port=port,
                      nproc=nproc, fault_rank=fault_rank)
        exited = time.time()
        ckpts = out / "checkpoints"
        r = SimpleNamespace(proc=proc, out=out, resumed=None,
                            down_after=exited - float(stamp.read_text()) if stamp.exists() else None,
                            latest=latest_checkpoint(ckpts), tmp_left=bool(list(ckpts.glob("*.tmp-*"))))
        if name in relaunch:
            r.resumed = _train(model_dir, out, *extra, "--resume", master_port=port, nproc=nproc)
        r.shm_left = _shm_left(started)
        if name in resume and name not in relaunch:
            r.resumed = _run(model_dir, out, *extra, "--resume", nproc=nproc)
        return r

    with ThreadPoolExecutor(2) as pool:
        return dict(zip(faults, pool.map(run, faults)))


def _shm_left(since: float, settle_s: float = 30.0) -> list[str]:
    """The /dev/shm segments made since `since` that no process maps, once a dead
    rank's semaphores had settle_s to go: its reward workers' (multiprocessing,
    spawn) are unlinked by its resource tracker once every process holding the
    tracker's pipe (the rank, its workers) is gone, which on a loaded 2-core
    machine took more than 10 s after a relaunched run."""
    from hybrid_engine.rollout import cpu_shm

    deadline = time.monotonic() + settle_s
    while (left := cpu_shm.leftovers(since)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


# Whatever phase of step 3 a kill lands in, the resume starts from step 2's
# checkpoint; a killed save also leaves a .tmp- folder to sweep. Two resumes cover
# both (the others would repeat the sync one).
RESUMED_PHASES = ("sync", "save")


@pytest.fixture(scope="module")
def killed_runs(model_dir, tmp_path_factory) -> dict[str, SimpleNamespace]:
    """Rank 1 SIGKILLed in step 3's phase, once per phase; RESUMED_PHASES resumed,
    the sync's by a relaunch on the same port."""
    return _faulty_runs(model_dir, tmp_path_factory.mktemp("killed"),
                        {phase: f"{phase}:3" for phase in KILL_PHASES}, resume=RESUMED_PHASES,
                        relaunch=("sync",))


DEAD_BOUND_S = 10  # a dead peer's survivors are gone within this, whatever they wait in


def _assert_died_line(run: SimpleNamespace, phase: str | None, rank: int = 1,
                      group: str | None = None) -> None:
    """A survivor's one error line names the dead rank, its group (placement=
    grouped) and its phase (any, if None); the job was down within DEAD_BOUND_S
    of the kill and left nothing in /dev/shm."""
    text = run.proc.stdout
    assert run.proc.returncode != 0 and run.down_after is not None, text[-3000:]
    print(f"job down {run.down_after:.1f} s after SIGKILL in {phase}")
    assert run.down_after < DEAD_BOUND_S, text[-3000:]
    errors = [ln for ln in text.splitlines() if ln.startswith("error")]
    assert len(errors) == 1, text[-3000:]
    named = re.escape(phase) if phase else r"\w+"
    who = f", {group} group" if group else ""
    assert re.match(rf"error: rank {rank} \(pid \d+{who}, in phase '{named}'\) died \(killed or "
                    rf"crashed\); this rank \((?!{rank})\d\) was in phase '\w+'; aborting the "
                    r"job$", errors[0]), errors
    assert text.count("Traceback (most recent") == text.count("ChildFailedError:") <= 1, text[-3000:]
    assert run.shm_left == []


@pytest.mark.parametrize("phase", KILL_PHASES)
def test_killed_rank_stops_the_job_and_resume_reproduces(reference, killed_runs, phase) -> None:
    """The survivor leaves within 10 s with one line naming the dead rank and
    its phase, even waiting in vLLM's shared-memory all-reduce (rollout, sync),
    and removes the job's /dev/shm segments (the dead rank's too). The sync's
    resume reuses the killed launch's fixed --master_port at once (no
    --standalone: torchrun's run id is "none"): the killed launch's segments are
    too young for the sweep, and the new launch must not collide with them (was
    `create shm ... errno: 17`)."""
    run = killed_runs[phase]
    _assert_died_line(run, {"rollout": "generate"}.get(phase, phase))
    # Step 3 never completed: step 2's checkpoint is the newest complete one
    # (a save killed after writing its shards left a .tmp- folder, never used).
    ckpts = run.out / "checkpoints"
    assert run.latest == step_checkpoint_path(ckpts, 2)
    assert run.tmp_left == (phase == "save")
    if phase not in RESUMED_PHASES:
        return
    assert run.resumed.returncode == 0, run.resumed.stdout[-3000:]
    assert "errno: 17" not in run.resumed.stdout
    assert _steps(run.out) == _steps(reference)
    assert _eval_rows(run.out / "eval_samples.jsonl") == _eval_rows(reference / "eval_samples.jsonl")
    assert not list(ckpts.glob("*.tmp-*"))  # the killed save's folder was swept


# Separate placement with generation ahead: rank 0 trains, rank 1 samples in its
# generation thread while its main thread joins the step's collectives.
AHEAD = ("--placement=separate", "--rollout.num_ranks=1", "--rollout.tensor_parallel_size=1",
         "--async_rollout.max_staleness=1", "--algorithm.behaviour_logp=rollout")


@pytest.fixture(scope="module")
def ahead_reference(model_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ahead_reference") / "run"
    proc = _run(model_dir, out, *AHEAD)
    assert proc.returncode == 0, proc.stdout[-3000:]
    return out


@pytest.fixture(scope="module")
def ahead_killed_runs(model_dir, tmp_path_factory) -> dict[str, SimpleNamespace]:
    """Both kills fall in step 3 and leave step 2's checkpoint, the same in both
    (fixed seeds): one resume from it covers them."""
    return _faulty_runs(model_dir, tmp_path_factory.mktemp("ahead_killed"),
                        {f: f for f in ("rollout:4", "sync:3")}, *AHEAD, resume=("sync:3",))


@pytest.mark.parametrize("fault", ["rollout:4", "sync:3"])
def test_killed_rank_with_generation_ahead_stops_the_job_and_resume_reproduces(
        ahead_reference, ahead_killed_runs, fault) -> None:
    """The rollout rank SIGKILLed in its generation thread (its 4th generate: the
    batch of step 4, started in step 3) or in step 3's sync (receiving into the
    back buffer while that thread generates): the job is down within 60 s, and
    the resume from step 2 (with the batch generated ahead in its checkpoint)
    reproduces the uninterrupted run, staleness included."""
    run = ahead_killed_runs[fault]
    _assert_died_line(run, None)  # its main thread's phase, not its generation thread's
    assert run.latest == step_checkpoint_path(run.out / "checkpoints", 2)
    if run.resumed is None:  # the other kill's resume started from the same checkpoint
        return
    assert run.resumed.returncode == 0, run.resumed.stdout[-3000:]
    ref = _steps(ahead_reference)
    assert _steps(run.out) == ref
    assert [ref[s]["staleness_max"] for s in sorted(ref)] == [0.0, 1.0, 1.0, 1.0]
    # Separate placement: rank 0 trains, yet records the rollout rank's engine.
    assert json.loads((ahead_reference / "engine.json").read_text())["attention_backend"]


# Group colocation, PPO: the actor, its rollout and its reference on ranks 0-1, the
# critic on rank 2 (its own group), which is the rank killed.
GROUPED = ("--placement=grouped", "--placement_map=actor,rollout:0-1;critic:2",
           "--algorithm.advantage=gae", "--rollout.tensor_parallel_size=1")
# The critic rank's phase at each kill: waiting for the trajectories, scoring,
# training, waiting in the sync, writing its shards of the checkpoint.
CRITIC_KILLS = {"critic-generate": "generate", "critic-score": "score",
                "critic-train": "train", "critic-sync": "sync", "save": "save"}


@pytest.fixture(scope="module")
def grouped_reference(model_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("grouped_reference") / "run"
    proc = _run(model_dir, out, *GROUPED, nproc=3)
    assert proc.returncode == 0, proc.stdout[-3000:]
    return out


@pytest.fixture(scope="module")
def grouped_killed_runs(model_dir, tmp_path_factory) -> dict[str, SimpleNamespace]:
    """Rank 2 (the critic group) SIGKILLed in step 3, once per phase; the
    training kill resumed from step 2's checkpoint."""
    return _faulty_runs(model_dir, tmp_path_factory.mktemp("grouped_killed"),
                        {f: f"{f}:3" for f in CRITIC_KILLS}, *GROUPED, resume=("critic-train",),
                        nproc=3, fault_rank=2)


@pytest.mark.parametrize("fault", list(CRITIC_KILLS))
def test_a_killed_critic_rank_stops_a_grouped_job_and_resume_reproduces(
        grouped_reference, grouped_killed_runs, fault) -> None:
    """The job is down within 10 s with one line naming rank 2, the critic group
    and its phase; the resume from step 2 (both groups' shards) reproduces the
    uninterrupted run."""
    run = grouped_killed_runs[fault]
    _assert_died_line(run, CRITIC_KILLS[fault], rank=2, group="critic")
    assert run.latest == step_checkpoint_path(run.out / "checkpoints", 2)
    if run.resumed is None:
        return
    assert run.resumed.returncode == 0, run.resumed.stdout[-3000:]
    ref = _steps(grouped_reference)
    assert all("critic/vf_loss" in ref[s] for s in range(1, STEPS + 1))
    assert _steps(run.out) == ref


def test_sigterm_to_the_critic_rank_stops_a_grouped_job_cleanly(model_dir, grouped_reference,
                                                                  tmp_path) -> None:
    """Group colocation: SIGTERM to rank 2 (the critic group) in its second update:
    both groups finish step 2, write its checkpoint and the final model and exit 0
    with no traceback; a resume reproduces the straight run."""
    out = tmp_path / "run"
    proc = _train(model_dir, out, *GROUPED, fault="critic-train:2:term", stamp=tmp_path / "at",
                  nproc=3, fault_rank=2)
    text = proc.stdout
    assert proc.returncode == 0 and (tmp_path / "at").exists(), text[-3000:]
    assert "Traceback" not in text and "rank 2 got SIGTERM: stopping after the current step" \
        in text, text[-3000:]
    summary = _summary(text)
    assert (summary["steps"], summary["stop_reason"]) == (2, "signal"), summary
    assert (out / "final" / "COMPLETE").is_file()
    assert latest_checkpoint(out / "checkpoints") == step_checkpoint_path(out / "checkpoints", 2)
    proc = _run(model_dir, out, *GROUPED, "--resume", nproc=3)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert _steps(out) == _steps(grouped_reference)


def _summary(stdout: str) -> dict:
    lines = [ln for ln in stdout.splitlines() if ln.startswith('{"steps"')]
    assert len(lines) == 1, stdout[-3000:]
    return json.loads(lines[0])


@pytest.mark.parametrize("where", ["build:1:term", "train:2:term", "export:1:term"])
def test_sigterm_to_one_rank_stops_every_rank_cleanly(model_dir, reference, tmp_path,
                                                      where) -> None:
    """SIGTERM to one rank (a scheduler, an OOM handler) used to take the job down
    at once with a traceback, and at start-up or in the final export it left
    final.tmp-* behind. Now, wherever it lands, every rank finishes the step in
    progress, the checkpoint and final/ are complete, and all exit 0 with no
    traceback; a resume then reproduces the straight run."""
    out, phase = tmp_path / "run", where.split(":")[0]
    # The export's case needs the last step only: a job of 2 steps.
    proc = _train(model_dir, out, *(["--train.num_steps=2"] if phase == "export" else []),
                  fault=where, stamp=tmp_path / "at")
    text = proc.stdout
    assert proc.returncode == 0 and (tmp_path / "at").exists(), text[-3000:]
    assert "Traceback" not in text and not [ln for ln in text.splitlines()
                                            if ln.startswith("error")], text[-3000:]
    assert "rank 1 got SIGTERM: stopping after the current step" in text
    summary = _summary(text)
    steps = {"build": 0, "train": 2, "export": 2}[phase]
    assert summary["steps"] == steps, summary
    assert summary["stop_reason"] == ("num_steps" if phase == "export" else "signal"), summary
    assert (out / "final" / "COMPLETE").is_file() and not list(out.glob("final.*"))
    ckpts = out / "checkpoints"
    assert latest_checkpoint(ckpts) == (step_checkpoint_path(ckpts, steps) if steps else None)
    assert not list(ckpts.glob("*.tmp-*")) if ckpts.exists() else True
    if phase == "train":
        proc = _run(model_dir, out, "--resume")
        assert proc.returncode == 0, proc.stdout[-3000:]
        assert _steps(out) == _steps(reference)


def test_sigterm_to_torchrun_saves_and_every_rank_exits_cleanly(model_dir, tmp_path) -> None:
    """torchrun forwards SIGTERM to every rank and gives them its shutdown
    timeout (30 s unless --shutdown-timeout): the ranks finish the step, save,
    export and exit 0. torchrun itself then exits 1 with its SignalException
    (its own contract, not ours): the ranks print no traceback and no error."""
    out = tmp_path / "run"
    proc = _train(model_dir, out, fault="train:2:launcher-term", stamp=tmp_path / "at")
    text = proc.stdout
    print(f"torchrun exit code after SIGTERM: {proc.returncode}")
    assert "rank 0 got SIGTERM" in text and "rank 1 got SIGTERM" in text, text[-3000:]
    assert not [ln for ln in text.splitlines() if ln.startswith("error")], text[-3000:]
    # One traceback at most: torchrun's own SignalException, none from a rank.
    assert text.count("Traceback (most recent call last)") == text.count(
        "SignalException: Process") <= 1, text[-3000:]
    ckpts = out / "checkpoints"
    assert latest_checkpoint(ckpts) == step_checkpoint_path(ckpts, 2), text[-3000:]
    assert (out / "final" / "COMPLETE").is_file() and not list(out.glob("final.*"))


@pytest.mark.parametrize("where", ["train:2", "start:1"])
def test_sigterm_to_hybrid_engine_launch_exits_0(model_dir, reference, tmp_path,
                                                 where) -> None:
    """`python -m hybrid_engine.launch` (torchrun's arguments; what `hybrid-engine
    train --nproc N` runs) sends SIGTERM to the ranks, not to torchrun: they stop
    after the step, save and export, and torchrun and the launcher exit 0 with no
    traceback (plain torchrun exits 1 with its SignalException, the test above).
    At start-up the signal is held until a rank catches SIGTERM, instead of killing
    a rank whose interpreter is still starting."""
    out = tmp_path / "run"
    proc = _train(model_dir, out, fault=f"{where}:launch-term", stamp=tmp_path / "at",
                  launcher="hybrid_engine.launch")
    text = proc.stdout
    assert proc.returncode == 0 and (tmp_path / "at").exists(), text[-3000:]
    assert "Traceback" not in text and not [ln for ln in text.splitlines()
                                            if ln.startswith("error")], text[-3000:]
    assert "rank 0 got SIGTERM" in text and "rank 1 got SIGTERM" in text, text[-3000:]
    assert text.count("hybrid_engine.launch: SIGTERM to rank pid") == 2, text[-3000:]
    steps = 2 if where.startswith("train") else 0
    summary = _summary(text)
    assert summary["steps"] == steps and summary["stop_reason"] == "signal", summary
    ckpts = out / "checkpoints"
    assert latest_checkpoint(ckpts) == (step_checkpoint_path(ckpts, steps) if steps else None)
    assert (out / "final" / "COMPLETE").is_file() and not list(out.glob("final.*"))
    if steps:
        assert _steps(out) == {s: m for s, m in _steps(reference).items() if s <= steps}


def test_sigkill_to_hybrid_engine_launch_takes_the_job_down(model_dir, tmp_path) -> None:
    """SIGKILL to the launcher kills torchrun with it (PR_SET_PDEATHSIG), and the
    ranks, orphaned, leave within a watchdog beat: nothing is left running."""
    out, stamp = tmp_path / "run", tmp_path / "killed_at"
    proc = _train(model_dir, out, "--collective_timeout_s=60", "--train.num_steps=50",
                  fault="train:2:launch", stamp=stamp, launcher="hybrid_engine.launch")
    down_after = time.time() - float(stamp.read_text())
    print(f"ranks down {down_after:.1f} s after SIGKILL to hybrid_engine.launch")
    assert proc.returncode == -9, proc.stdout[-3000:]
    errors = [ln for ln in proc.stdout.splitlines() if ln.startswith("error")]
    assert len(errors) == 1 and "the launcher (torchrun, pid" in errors[0], proc.stdout[-3000:]
    assert down_after < 20, proc.stdout[-3000:]
    assert processes_mentioning(str(out)) == []


# The watchdog that names a silent peer does not depend on the phase; these are the
# two where the survivor spins in vLLM's shared-memory all-reduce, which no
# collective timeout covers (training and saving wait in gloo collectives).
STOP_PHASES = ("rollout", "sync")
STOP_TIMEOUT_S = 20


@pytest.fixture(scope="module")
def stopped_runs(model_dir, tmp_path_factory) -> dict[str, SimpleNamespace]:
    """Rank 1 SIGSTOPped in step 2's phase, once per phase: each job waits out
    collective_timeout_s (four at once took no less than two: the rest is CPU-bound)."""
    return _faulty_runs(model_dir, tmp_path_factory.mktemp("stopped"),
                        {phase: f"{phase}:2:stop" for phase in STOP_PHASES},
                        f"--collective_timeout_s={STOP_TIMEOUT_S}")


@pytest.mark.parametrize("phase", STOP_PHASES)
def test_stopped_rank_brings_the_job_down_with_one_error_line(stopped_runs, phase) -> None:
    """A SIGSTOPped rank neither exits nor answers: vLLM's shared-memory all-reduce
    would spin on it forever. The watchdog names it and ends the job within
    collective_timeout_s + 30 s, leaving no process behind."""
    run = stopped_runs[phase]
    text = run.proc.stdout
    assert run.proc.returncode != 0 and run.down_after is not None, text[-3000:]
    print(f"{phase}: job down {run.down_after:.1f} s after SIGSTOP (timeout {STOP_TIMEOUT_S} s)")
    assert run.down_after < STOP_TIMEOUT_S + 30, text[-3000:]
    errors = [ln for ln in text.splitlines() if ln.startswith("error")]
    assert len(errors) == 1 and errors[0].startswith("error: rank 1 (last in phase "), errors
    assert "stopped, hung or dead" in errors[0]
    assert processes_mentioning(str(run.out)) == []  # the stopped rank was killed, not left behind
    assert run.shm_left == []


def test_ranks_exit_when_their_launcher_dies(model_dir, tmp_path) -> None:
    """SIGKILL to torchrun leaves its ranks as orphans that nothing will stop;
    each notices its new parent within one watchdog beat and exits, with one
    error line, leaving no process behind."""
    out, stamp = tmp_path / "run", tmp_path / "killed_at"
    # With collective_timeout_s=60 the store's silence would take 60 s to notice.
    proc = _train(model_dir, out, "--collective_timeout_s=60", "--train.num_steps=50",
                  fault="train:2:launcher", stamp=stamp)
    # torchrun died at once; communicate() returns when the ranks close its pipe.
    down_after = time.time() - float(stamp.read_text())
    print(f"ranks down {down_after:.1f} s after SIGKILL to torchrun")
    errors = [ln for ln in proc.stdout.splitlines() if ln.startswith("error")]
    assert len(errors) == 1 and "the launcher (torchrun, pid" in errors[0], proc.stdout[-3000:]
    assert down_after < 20, proc.stdout[-3000:]
    assert processes_mentioning(str(out)) == []


def test_ranks_exit_when_their_launcher_dies_at_start_up(model_dir, tmp_path) -> None:
    """torchrun SIGKILLed before the rendezvous (found by `make chaos`: its ranks
    waited in the rendezvous for minutes): the rank whose launcher was already gone
    when it started, and its peer, leave within seconds with one error line."""
    out, stamp = tmp_path / "run", tmp_path / "killed_at"
    proc = _train(model_dir, out, fault="start:1:launcher", stamp=stamp)
    down_after = time.time() - float(stamp.read_text())
    print(f"ranks down {down_after:.1f} s after SIGKILL to torchrun at start-up")
    errors = [ln for ln in proc.stdout.splitlines() if ln.startswith("error")]
    assert errors and all("the launcher (torchrun" in e for e in errors), proc.stdout[-3000:]
    assert down_after < 20, proc.stdout[-3000:]
    assert processes_mentioning(str(out)) == []


def test_a_second_job_on_the_same_output_dir_is_refused(model_dir, tmp_path) -> None:
    """Two jobs into one output_dir used to interleave metrics.jsonl and overwrite
    each other's checkpoints; the second (here with --overwrite, which would
    have deleted the first's outputs) now gets one error line and touches
    nothing."""
    import threading

    out, first, release = tmp_path / "run", [], tmp_path / "release"
    # The first job's reward waits for `release` from step 2 on: it is surely
    # still running (with a checkpoint and metrics rows) while the second starts.
    (tmp_path / "reward.py").write_text(
        "import os, time, zlib\n\n"
        "def reward(prompt, completion, answer):\n"
        f"    while os.path.exists({str(step_checkpoint_path(out / 'checkpoints', 1))!r}) "
        f"and not os.path.exists({str(release)!r}):\n"
        "        time.sleep(0.2)\n"
        "    return float(zlib.crc32(completion.encode()) % 2)\n")
    runner = threading.Thread(target=lambda: first.append(_run(
        model_dir, out, "--train.num_steps=3", "--env.reward_timeout_s=600",
        f"--env.reward_fn={tmp_path / 'reward.py'}:reward")))
    runner.start()
    deadline = time.time() + 240
    while not step_checkpoint_path(out / "checkpoints", 1).exists():
        assert time.time() < deadline and runner.is_alive(), "the first job never saved"
        time.sleep(0.5)
    second = _run(model_dir, out, "--overwrite")
    release.write_text("go")
    runner.join()
    errors = [ln for ln in second.stdout.splitlines() if ln.startswith("error")]
    assert second.returncode != 0 and len(errors) == 1, second.stdout[-3000:]
    assert "is in use by a running job (pid " in errors[0], errors
    assert first[0].returncode == 0, first[0].stdout[-3000:]
    rows = _steps(out)
    assert sorted(rows) == list(range(0, 4)) or sorted(rows) == list(range(1, 4)), sorted(rows)
    lines = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if "eval_s" not in r] == sorted(rows)  # no step twice
    assert latest_checkpoint(out / "checkpoints") == step_checkpoint_path(out / "checkpoints", 3)


def test_a_failed_save_stops_with_one_error_and_resume_continues(model_dir, reference,
                                                                 tmp_path) -> None:
    """A full disk during a save (rank 1's files may not grow past 64 KiB from the
    3rd save on) used to print torch's 'inline_container' error; now one error
    line says so, no half-written folder stays, and a resume reproduces the
    straight run."""
    out = tmp_path / "run"
    proc = _train(model_dir, out, fault="save:3:fsize", stamp=tmp_path / "at")
    errors = [ln for ln in proc.stdout.splitlines() if ln.startswith("error")]
    assert proc.returncode != 0 and len(errors) == 1, proc.stdout[-3000:]
    assert "could not write checkpoint" in errors[0] and "step_00000003" in errors[0], errors
    assert "rank 1: no space left on device" in errors[0], errors
    assert "inline_container" not in proc.stdout
    # No rank's traceback: the only one is torchrun's own report of a non-zero exit.
    assert proc.stdout.count("Traceback (most recent") == proc.stdout.count(
        "ChildFailedError:") <= 1, proc.stdout[-3000:]
    ckpts = out / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_00000001", "step_00000002"]
    proc = _run(model_dir, out, "--resume")
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert _steps(out) == _steps(reference)


def test_eval_on_the_final_model_reproduces_the_runs_last_greedy_evaluation(
        model_dir, reference, tmp_path) -> None:
    """`hybrid-engine eval` on the run's final/ export, 2 ranks, the eval file alone
    (evaluated whole by default), no trainer built: the same prompts, greedy
    metrics and greedy completions as the run's last evaluation, exactly; its
    --output holds each prompt x sample once, and its pass@k comes back from
    those lines."""
    out = tmp_path / "samples.jsonl"
    proc = run_job(
        ["eval", "--recipe=tiny_grpo_debug",
         f"--model.path={reference / 'final'}", "--rollout.max_tokens=8",
         f"--env.reward_fn={model_dir.parent / 'reward.py'}:reward",
         f"--env.eval_dataset_path={model_dir.parent / 'eval.jsonl'}",
         "--eval.num_samples=2", f"--output={out}"], 2, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "no trainer (evaluation only)" in proc.stdout
    got = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith('{"model"')][-1])
    assert re.search(rf"^eval/accuracy +{got['eval/accuracy']:.4f}$", proc.stdout, re.M)  # table
    last = _steps(reference)[STEPS]
    for key in ("eval/prompts", "eval/accuracy", "eval/reward_mean", "eval/response_len_mean"):
        assert got[key] == last[key], key
    assert got["step"] == 0 and "eval/pass@2" in got and "eval/pass@4" not in got
    rows = _eval_rows(out)
    assert sorted((r["pass"], r["prompt_index"], r["sample"]) for r in rows) == sorted(
        [("greedy", p, 0) for p in range(len(EVAL_ROWS))]
        + [("sampled", p, k) for p in range(len(EVAL_ROWS)) for k in range(2)])
    fields = ("prompt_index", "prompt", "completion", "answer", "rewards", "correct")
    run_greedy = [r for r in _eval_rows(reference / "eval_samples.jsonl") if r["pass"] == "greedy"]
    assert ([[r[f] for f in fields] for r in rows if r["pass"] == "greedy"]
            == [[r[f] for f in fields] for r in run_greedy])
    correct = {}
    for r in rows:
        if r["pass"] == "sampled":
            correct.setdefault(r["prompt_index"], []).append(r["correct"])
    pass2 = sum(1 - math.comb(2 - sum(c), 2) / math.comb(2, 2) for c in correct.values())
    assert got["eval/pass@2"] == pytest.approx(pass2 / len(correct), abs=1e-12)


def test_a_damaged_newest_checkpoint_yields_to_the_one_before(model_dir, reference,
                                                              tmp_path) -> None:
    """Bytes flipped in the newest checkpoint's shard: the resume names it, warns,
    and continues from the one before, reproducing the straight run. The damaged
    folder is kept under another name, so keep_checkpoints counts (and keeps) only
    sound ones."""
    out = tmp_path / "run"
    shutil.copytree(reference, out)
    ckpts = out / "checkpoints"
    newest = step_checkpoint_path(ckpts, STEPS)
    shard = sorted((newest / "dcp").glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    rows = (out / "metrics.jsonl").read_text().splitlines()
    (out / "metrics.jsonl").write_text("\n".join(rows[:-1]) + "\n")  # as if step 4 had not ended
    proc = _run(model_dir, out, "--resume")
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert f"checkpoint {newest} is damaged ({shard.relative_to(newest)} does not match its " \
           "checksum): resuming from the one before" in proc.stdout, proc.stdout[-3000:]
    assert _steps(out) == _steps(reference)
    kept = sorted(p.name for p in ckpts.iterdir())
    assert kept[:2] == ["step_00000003", "step_00000004"], kept  # step 4 saved again, sound
    assert len(kept) == 3 and kept[2].startswith("step_00000004.damaged-"), kept


def _files_of(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for d in ("checkpoints", "final")
            for p in sorted((out / d).rglob("*")) if p.is_file()}


def test_resume_refuses_another_models_checkpoint(model_dir, reference, tmp_path) -> None:
    """A Llama of the run's Qwen2 shapes (no q/k/v biases) is refused before any engine
    starts, leaving the checkpoints and final/ as they were (in-process, every case:
    tests/test_resume_model.py); with --allow-model-change a model of another shape
    is warned about, then refused by the load's shape check."""
    from hybrid_engine.models.tiny import PRESETS, write_tiny_model

    llama = write_tiny_model(tmp_path / "llama", dataclasses.replace(PRESETS["tiny"], arch="llama"))
    spec = dataclasses.replace(PRESETS["tiny"], intermediate_size=PRESETS["tiny"].intermediate_size * 2)
    other = write_tiny_model(tmp_path / "wider", spec)
    for name in ("reward.py", "train.jsonl", "eval.jsonl"):
        shutil.copy(model_dir.parent / name, tmp_path / name)
    out = tmp_path / "run"
    shutil.copytree(reference, out)
    before = _files_of(out)
    proc = _run(llama, out, "--resume")
    errors = [ln for ln in proc.stdout.splitlines() if ln.startswith("error")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stdout[-3000:]
    assert "Traceback" not in proc.stdout, proc.stdout[-3000:]
    assert errors[0].startswith(f"error: --resume: the run in {out} was made from a "
                                "Qwen2ForCausalLM (model.path="), errors[0]
    assert f"not the LlamaForCausalLM at model.path={str(llama)!r}" in errors[0]
    assert _files_of(out) == before
    proc = _run(other, out, "--resume", "--allow-model-change")
    errors = [ln for ln in proc.stdout.splitlines() if ln.startswith("error")]
    assert proc.returncode != 0 and len(errors) == 1, proc.stdout[-3000:]
    assert proc.stdout.count("--allow-model-change: the run in") == 1, proc.stdout[-3000:]
    assert "intermediate_size 256 there, 512 here" in proc.stdout
    assert "was saved from a model of another shape" in errors[0]
    assert "mlp.up_proj.weight" in errors[0] or "mlp.gate_proj.weight" in errors[0]


def test_overwrite_starts_over_in_an_earlier_runs_folder(model_dir, reference, tmp_path) -> None:
    """Without --overwrite the same folder is refused before anything is touched
    (in-process: tests/test_preflight.py); with it, the earlier run's checkpoints go."""
    out = tmp_path / "run"
    shutil.copytree(reference, out)
    proc = _run(model_dir, out, "--overwrite", "--train.num_steps=1")
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_00000001"]
