"""Kills at random moments of a real 2-rank run: time to exit, leftovers,
checkpoints, and a resume that must reproduce the uninterrupted run.

    python benchmarks/chaos.py --kills 20 --seed 0      # make chaos
    python benchmarks/chaos.py --kills 1 --seed 3 --out-dir=/tmp/x   # the test suite's sample

A trial starts `hybrid-engine train` (a tiny random model, the tiny_grpo_debug
recipe, --steps steps, a checkpoint every step, a coin-flip reward so every
step trains) under torchrun with a fixed master port. After a delay drawn from
[5 %, 95 %] of the reference run's measured duration (seeded), it SIGKILLs one
target drawn from rank 0, rank 1 and torchrun itself. It then measures:
- down_s: from the kill until no process of the job is left (torchrun, its
  ranks, which torchrun starts in sessions of their own, and their helpers);
- leftovers right after the job is down: processes, the master port still
  listening, and /dev/shm entries new since the trial began (a killed process
  cannot remove its own: the survivors remove the job's as they leave); then
  again after the resume: both must be none;
- the checkpoints: every `step_<n>` folder must be sound
  (`checkpoint_problem`: complete, every file's checksum); `.tmp-` folders of
  a save cut short are counted (the resume removes them);
- resume: `--resume` to the end; its per-step metrics (wall times and memory
  left out) must equal the reference run's.

Writes a table and the trials as JSON to
benchmarks/results/chaos_<device>_<yyyymm>.md; the last stdout line is JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _common

REPO = Path(__file__).resolve().parents[1]
TARGETS = ("rank0", "rank1", "torchrun")


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kills", type=int, default=20, help="trials, one kill each (default 20)")
    p.add_argument("--seed", type=int, default=0, help="draws the moments and targets")
    p.add_argument("--steps", type=int, default=6, help="RL steps of the run (default 6)")
    p.add_argument("--timeout", type=float, default=10.0,
                   help="a job must be down this many seconds after the kill (default 10)")
    p.add_argument("--out-dir", default=str(REPO / "benchmarks" / "results"))
    p.add_argument("--work-dir", default=None, help="where runs go (default: a temporary folder)")
    return p.parse_args(argv)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _command(model: Path, out: Path, steps: int, port: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--master_addr=127.0.0.1",
            f"--master_port={port}", "--nproc_per_node=2", "-m", "hybrid_engine.cli", "train",
            "--recipe=tiny_grpo_debug", "--no-progress", f"--model.path={model}",
            f"--output_dir={out}", "--rollout.max_tokens=8", "--sync.verify=false",
            f"--train.num_steps={steps}", "--checkpoint_every=1", "--keep_checkpoints=2",
            "--train.lr=1e-3", "--collective_timeout_s=30",
            f"--env.reward_fn={model.parent / 'reward.py'}:reward", *extra]


def _start(cmd: list[str], log: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)


def _job_pids(proc: subprocess.Popen, out: Path) -> list[int]:
    """Live processes of the job: torchrun, its descendants (torchrun starts each
    rank in a session of its own) and anything whose command line names the
    run's output folder (a rank orphaned by a killed torchrun)."""
    import psutil

    pids = set()
    try:
        root = psutil.Process(proc.pid)
        pids = {root.pid} | {c.pid for c in root.children(recursive=True)}
    except psutil.Error:
        pass
    for p in psutil.process_iter(["cmdline"]):
        if f"--output_dir={out}" in (p.info["cmdline"] or []):
            pids.add(p.pid)
    live = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                live.append(pid)
        except psutil.Error:
            continue
    return live


def _listening(port: int) -> bool:
    import psutil

    return any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port
               for c in psutil.net_connections(kind="tcp"))


def _shm() -> set[str]:
    return {p.name for p in Path("/dev/shm").iterdir()}


def _steps(out: Path) -> dict[int, dict]:
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: {k: v for k, v in r.items() if not (k.endswith("_s") or k.startswith("mem_"))}
            for r in rows}


def _checkpoints(out: Path) -> tuple[int, list[str], int]:
    """(sound step_<n> folders, problems of the others, .tmp- folders)."""
    from hybrid_engine.checkpoint import checkpoint_problem

    root = out / "checkpoints"
    if not root.is_dir():
        return 0, [], 0
    sound, bad = 0, []
    for p in sorted(root.glob("step_*")):
        if ".tmp-" in p.name:
            continue
        problem = checkpoint_problem(p)
        if problem is None:
            sound += 1
        else:
            bad.append(f"{p.name}: {problem}")
    return sound, bad, len(list(root.glob("*.tmp-*")))


def _model(work: Path) -> Path:
    from hybrid_engine.models.tiny import PRESETS, write_tiny_model

    folder = write_tiny_model(work / "model" / "tiny", PRESETS["tiny"])
    (folder.parent / "reward.py").write_text(
        "import zlib\n\n"
        "def reward(prompt, completion, answer):\n"
        "    return float(zlib.crc32(completion.encode()) % 2)\n")
    return folder


def _reference(model: Path, work: Path, steps: int) -> tuple[dict, float]:
    out, t0 = work / "reference", time.monotonic()
    proc = _start(_command(model, out, steps, _free_port()), work / "reference.log")
    if proc.wait(timeout=900) != 0:
        raise SystemExit(f"error: the reference run failed; see {work / 'reference.log'}")
    return _steps(out), time.monotonic() - t0


def _pid_of(proc: subprocess.Popen, target: str, deadline: float) -> int | None:
    """torchrun's pid, or the pid of the rank whose environment says RANK=<n>."""
    import psutil

    if target == "torchrun":
        return proc.pid
    want = f"RANK={target[-1]}"
    while time.monotonic() < deadline:
        for child in psutil.Process(proc.pid).children():
            try:
                env = child.environ()
            except psutil.Error:
                continue
            if f"RANK={env.get('RANK')}" == want:
                return child.pid
        time.sleep(0.2)
    return None


def trial(i: int, rng: random.Random, model: Path, work: Path, steps: int, ref: dict,
          ref_s: float, timeout: float) -> dict:
    out, port = work / f"trial{i:02d}", _free_port()
    target, delay = rng.choice(TARGETS), rng.uniform(0.05, 0.95) * ref_s
    shm_before = _shm()
    t0 = time.monotonic()
    proc = _start(_command(model, out, steps, port), work / f"trial{i:02d}.log")
    pid = _pid_of(proc, target, t0 + delay)
    time.sleep(max(0.0, t0 + delay - time.monotonic()))
    row: dict = {"trial": i, "target": target, "at_s": round(delay, 1)}
    try:
        if proc.poll() is not None or pid is None:
            raise ProcessLookupError
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        row.update(killed=False, note="the run ended before the kill")
    else:
        killed_at = time.monotonic()
        while _job_pids(proc, out) and time.monotonic() - killed_at < timeout + 60:
            time.sleep(0.1)
        row.update(killed=True, down_s=round(time.monotonic() - killed_at, 1))
    proc.wait()
    time.sleep(1.0)
    left = _job_pids(proc, out)
    row["procs_left"] = len(left)
    for pid_left in left:  # counted above; never leave the machine dirty
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid_left, signal.SIGKILL)
    row["port_left"] = _listening(port)
    new_shm = sorted(_shm() - shm_before)  # named: another job's entries are told apart
    row["shm_left_at_exit"], row["shm_names_at_exit"] = len(new_shm), new_shm
    row["sound_ckpts"], bad, row["tmp_folders"] = _checkpoints(out)
    row["damaged_ckpts"] = bad
    resumable = row["sound_ckpts"] > 0  # a kill mid-save leaves only a .tmp- folder
    cmd = _command(model, out, steps, _free_port(), *(["--resume"] if resumable else ["--overwrite"]))
    rc = _start(cmd, work / f"trial{i:02d}.resume.log").wait(timeout=900)
    row["resumed"] = resumable
    row["resume_ok"] = rc == 0 and _steps(out) == ref
    row["shm_left_after_resume"] = sorted(_shm() - shm_before)
    return row


def _table(rows: list[dict], timeout: float) -> str:
    head = ("| # | target | kill at s | down s | procs left | port left | /dev/shm new at exit "
            "| after resume | sound ckpts | damaged | .tmp- | resumed | metrics = straight run |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")
    body = "".join(
        f"| {r['trial']} | {r['target']} | {r['at_s']} | {r.get('down_s', '-')} | "
        f"{r['procs_left']} | {r['port_left']} | {r['shm_left_at_exit']} | "
        f"{len(r['shm_left_after_resume'])} | {r['sound_ckpts']} | {len(r['damaged_ckpts'])} | "
        f"{r['tmp_folders']} | {r['resumed']} | {r['resume_ok']} |\n" for r in rows)
    killed = [r for r in rows if r["killed"]]
    downs = sorted(r["down_s"] for r in killed)
    summary = (f"\n{len(killed)} of {len(rows)} trials killed a process "
               f"(the others' run had ended first). Down after the kill: median "
               f"{downs[len(downs) // 2] if downs else '-'} s, max {max(downs, default='-')} s "
               f"(bound {timeout:.0f} s). Trials with a process, the port or a /dev/shm entry "
               f"left: {sum(bool(r['procs_left'] or r['port_left'] or r['shm_left_at_exit'] or r['shm_left_after_resume']) for r in rows)}. "
               f"Damaged checkpoints: {sum(len(r['damaged_ckpts']) for r in rows)}. "
               f"Resumes reproducing the straight run: {sum(r['resume_ok'] for r in rows)} of {len(rows)}.\n")
    return head + body + summary


def ok(row: dict, timeout: float) -> bool:
    """What the acceptance asks of one trial."""
    return ((not row["killed"] or row["down_s"] < timeout) and row["procs_left"] == 0
            and not row["port_left"] and not row["shm_left_at_exit"]
            and not row["shm_left_after_resume"]
            and not row["damaged_ckpts"] and row["resume_ok"])


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="chaos-", dir=args.work_dir) as tmp:
        work = Path(tmp)
        model = _model(work)
        ref, ref_s = _reference(model, work, args.steps)
        print(f"[chaos] reference run: {args.steps} steps in {ref_s:.1f} s", flush=True)
        rows = []
        for i in range(args.kills):
            rows.append(trial(i, rng, model, work, args.steps, ref, ref_s, args.timeout))
            r = rows[-1]
            print(f"[chaos] {i}: {r['target']} at {r['at_s']} s -> down {r.get('down_s', '-')} s, "
                  f"resume {'ok' if r['resume_ok'] else 'DIFFERS'}, "
                  f"{'ok' if ok(r, args.timeout) else 'FAILED'}", flush=True)
    path = _common.result_path(args.out_dir, "chaos")
    path.write_text(_common.result_header(__file__, argv)
                    + f"Reference run: {args.steps} steps, {ref_s:.1f} s; seed {args.seed}.\n\n"
                    + _table(rows, args.timeout)
                    + f"\n```json\n{json.dumps(rows, indent=1)}\n```\n")
    passed = sum(ok(r, args.timeout) for r in rows)
    print(json.dumps({"trials": len(rows), "passed": passed, "result": str(path),
                      "rows": rows}))
    return 0 if passed == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
