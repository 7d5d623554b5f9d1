"""PPO with a critic, a reference and a reward model, three placements on the same ranks.

Fresh `hybrid-engine train` jobs under torchrun on N ranks (default 6), one per
placement per round, placements in rotating order, --jobs rounds; the same
model, prompts, sampling and seeds (the recipe tiny_grpo_debug, GAE critic,
KL reference, a reward model of the policy's size whose score is half the
reward, rollout TP 1):

- colocated: every rank holds the actor, its engine, the reference, the
  critic and the reward model, taking turns;
- separate: the actor, reference and critic on the first G ranks (FSDP2 over
  them), the engines on the last N - G, the reward model on every rank;
- grouped: the actor, its engine and the reference on the first G ranks, taking
  turns; the critic and the reward model on the last N - G (`placement_map`).

Per job: the median step time over the steps after the first (the first
compiles and warms the engine), each rank's peak RSS (the rank's own process,
which holds the engine on CPU; sampled every 50 ms), and, grouped, the critic group's own
seconds (the reward model's and the critic's scoring, which run while the
actor group scores the reference; training) with the time it overlapped the actor group's
training: actor train + critic train - the train phase's wall time (both start
at the phase's start; the phase ends when the later one does).

Prints a table (median and 95% bootstrap interval over the jobs; ratios to
colocated); the last stdout line is JSON. Writes
benchmarks/results/placement_<device>_<yyyymm>.md.

    python benchmarks/bench_placement.py                 # small preset, N=6, 4+2, 3 jobs each
    python benchmarks/bench_placement.py --quick         # tiny preset, 1 job each
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import _common
import _stats

REPO = Path(__file__).resolve().parents[1]
MODES = ("colocated", "separate", "grouped")
# A reward with signal in every group (a random-init model solves nothing), so every
# step trains both the policy and the critic.
REWARD = ("import zlib\n\ndef reward(prompt, completion, answer):\n"
          "    return float(zlib.crc32(completion.encode()) % 2)\n")


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="small",
                   help="tiny-model preset (hybrid_engine.models.tiny)")
    p.add_argument("--nproc", type=int, default=6, help="ranks N")
    p.add_argument("--group", type=int, default=4,
                   help="G: the actor group's ranks (grouped) and the trainer ranks (separate)")
    p.add_argument("--jobs", type=int, default=3, help="fresh jobs per placement")
    p.add_argument("--steps", type=int, default=4, help="RL steps per job (the first is not timed)")
    p.add_argument("--prompts", type=int, default=12, help="prompts per step")
    p.add_argument("--samples", type=int, default=4, help="completions per prompt")
    p.add_argument("--max-tokens", type=int, default=32, help="new tokens per completion")
    p.add_argument("--quick", action="store_true", help="tiny preset, 1 job each, 3 steps")
    p.add_argument("--out-dir", default=str(REPO / "benchmarks" / "results"))
    args = p.parse_args(argv)
    if args.quick:
        args.preset, args.jobs, args.steps = "tiny", 1, 3
    if not 1 <= args.group < args.nproc:
        p.error(f"--group must leave ranks for the other group: 1 <= G < N={args.nproc}")
    return args


def _overrides(args: argparse.Namespace, mode: str, model: Path, out: Path) -> list[str]:
    g, n = args.group, args.nproc
    placement = {
        "colocated": [],
        "separate": ["--placement=separate", f"--rollout.num_ranks={n - g}"],
        "grouped": ["--placement=grouped", f"--placement_map=actor,rollout,reference:0-{g - 1};"
                    f"critic,reward_model:{g}-{n - 1}"],
    }[mode]
    return [f"--model.path={model}", f"--output_dir={out}", "--no-progress",
            "--algorithm.advantage=gae", "--algorithm.kl_coef=0.05",
            "--rollout.tensor_parallel_size=1", f"--train.num_steps={args.steps}",
            f"--train.prompts_per_step={args.prompts}",
            f"--rollout.num_samples_per_prompt={args.samples}",
            f"--rollout.max_tokens={args.max_tokens}", "--train.sharding=full",
            "--checkpoint_every=0", "--eval.at_start=false", "--eval.at_end=false",
            "--eval.every=0", "--env.reward_fn=", f"--env.reward_model_path={out.parent / 'rm'}",
            f"--env.rewards={out.parent / 'reward.py'}:reward:1.0,reward_model:0.5", *placement]


class PeakRss:
    """Samples every rank's RSS under a launcher pid (the rank's own process: the
    engine runs in it on CPU; its reward workers, alike in every placement, not)."""

    def __init__(self, root_pid: int, interval_s: float = 0.05) -> None:
        import psutil

        self.root, self.interval_s = psutil.Process(root_pid), interval_s
        self.peak: dict[int, int] = {}
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import psutil

        while not self._done.wait(self.interval_s):
            try:
                procs = self.root.children(recursive=True)
            except psutil.Error:
                return
            for p in procs:
                try:
                    rank = p.environ().get("RANK")
                    if rank is None or p.parent().pid != self.root.pid:
                        continue  # a rank is the launcher's child (not its reward workers)
                    rss = p.memory_info().rss
                except psutil.Error:
                    continue
                self.peak[int(rank)] = max(self.peak.get(int(rank), 0), rss)

    def stop(self) -> dict[int, int]:
        self._done.set()
        self._thread.join(timeout=5)
        return dict(sorted(self.peak.items()))


def run_job(args: argparse.Namespace, mode: str, model: Path, work: Path) -> dict:
    """One fresh job of mode: its steps' metrics and its ranks' peak RSS."""
    out = work / f"{mode}-{time.monotonic_ns()}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={args.nproc}", "-m", "hybrid_engine.cli", "train",
           "--recipe=tiny_grpo_debug", *_overrides(args, mode, model, out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, cwd=REPO)
    rss = PeakRss(proc.pid)
    text, _ = proc.communicate(timeout=3600)
    peak = rss.stop()
    if proc.returncode != 0:
        raise SystemExit(f"{mode} failed:\n{text[-4000:]}")
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r["step"] >= 1]
    if any(r["skipped_degenerate"] for r in rows):
        raise SystemExit(f"{mode}: a step trained nothing (all rewards equal): {out}")
    steps = [b["elapsed_s"] - a["elapsed_s"] for a, b in zip(rows, rows[1:])]
    timed = rows[1:]
    out = {"step_s": statistics.median(steps), "peak_rss": peak,
           "phases": {k: statistics.median(r[f"{k}_s"] for r in timed)
                      for k in ("generate", "score", "train", "sync")}}
    if mode == "grouped":
        critic_train = [r["placement/critic_train_s"] for r in timed]
        for role in ("critic", "reward_model"):
            out[f"{role}_score_s"] = statistics.median(r[f"placement/{role}_score_s"]
                                                       for r in timed)
        out["critic_train_s"] = statistics.median(critic_train)
        out["overlap_s"] = statistics.median(
            max(0.0, r["train_step_s"] + c - r["train_s"]) for r, c in zip(timed, critic_train))
        out["bytes"] = {k: statistics.median(r[f"placement/{k}_bytes"] for r in timed)
                        for k in ("trajectory", "critic", "reward_model")}
    return out


def _ci(values: list[float], base: list[float]) -> str:
    lo, hi = _stats.ratio_ci([[v] for v in values], [[b] for b in base], paired=False)
    return f"{_stats.ratio([[v] for v in values], [[b] for b in base]):.2f} [{lo:.2f}, {hi:.2f}]"


def report(args: argparse.Namespace, jobs: dict[str, list[dict]]) -> tuple[str, dict]:
    """The markdown table and the JSON summary."""
    g, n = args.group, args.nproc
    lines = ["| placement | step s, median (min-max) | vs colocated [95% CI] | peak RSS GiB, "
             "biggest rank (min-max) | per rank (median of jobs) |", "|---|---|---|---|---|"]
    summary: dict = {"nproc": n, "group": g, "preset": args.preset, "jobs": args.jobs}
    base = [j["step_s"] for j in jobs["colocated"]]
    for mode in MODES:
        steps = [j["step_s"] for j in jobs[mode]]
        biggest = [max(j["peak_rss"].values()) / 2**30 for j in jobs[mode]]
        per_rank = [statistics.median(j["peak_rss"][r] for j in jobs[mode]) / 2**30
                    for r in range(n)]
        vs = "1" if mode == "colocated" else _ci(steps, base)
        lines.append(f"| {mode} | {statistics.median(steps):.2f} ({min(steps):.2f}-"
                     f"{max(steps):.2f}) | {vs} | {statistics.median(biggest):.2f} "
                     f"({min(biggest):.2f}-{max(biggest):.2f}) | "
                     f"{' '.join(f'{x:.2f}' for x in per_rank)} |")
        summary[mode] = {"step_s": steps, "peak_rss_gib_biggest": biggest,
                         "peak_rss_gib_per_rank": per_rank,
                         "phases": {k: statistics.median(j["phases"][k] for j in jobs[mode])
                                    for k in jobs[mode][0]["phases"]}}
    gj = jobs["grouped"]
    extra = {k: statistics.median(j[k] for j in gj)
             for k in ("critic_score_s", "reward_model_score_s", "critic_train_s", "overlap_s")}
    summary["grouped"].update(extra, bytes=gj[0]["bytes"])
    lines += ["", "Phases, median seconds (generate / score / train / sync):", ""]
    for mode in MODES:
        ph = summary[mode]["phases"]
        lines.append(f"- {mode}: " + " / ".join(f"{ph[k]:.2f}" for k in ph))
    lines += ["", f"Grouped: the critic group's own seconds per step, scoring "
              f"{extra['reward_model_score_s']:.2f} with the reward model and "
              f"{extra['critic_score_s']:.2f} with the critic while the actor group scored "
              f"the reference, and training {extra['critic_train_s']:.2f}; its training "
              f"overlapped the actor group's for {extra['overlap_s']:.2f} s a step. "
              f"Moved between the groups per step: {gj[0]['bytes']['trajectory'] / 1e3:.0f} kB "
              f"of trajectories, {gj[0]['bytes']['critic'] / 1e3:.1f} kB of values, "
              f"{gj[0]['bytes']['reward_model'] / 1e3:.2f} kB of reward model scores."]
    return "\n".join(lines), summary


def main(argv: list[str] | None = None) -> None:
    args = _args(argv)
    with tempfile.TemporaryDirectory(prefix="he_placement_") as tmp:
        work = Path(tmp)
        model = _common.preset_model(work / "models", args.preset)
        (work / "reward.py").write_text(REWARD)
        from hybrid_engine.envs.reward_model import write_tiny_reward_model
        from hybrid_engine.models.tiny import PRESETS

        write_tiny_reward_model(work / "rm", PRESETS[args.preset])
        jobs: dict[str, list[dict]] = {m: [] for m in MODES}
        for j in range(args.jobs):
            order = MODES[j % 3:] + MODES[:j % 3]  # rotating: no mode always runs first
            for mode in order:
                t0 = time.perf_counter()
                jobs[mode].append(run_job(args, mode, model, work))
                print(f"job {j} {mode}: step {jobs[mode][-1]['step_s']:.2f} s "
                      f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    table, summary = report(args, jobs)
    header = _common.result_header(__file__, argv)
    body = (f"{header}Workload: PPO (GAE critic, KL reference, a reward model's score as half "
            f"the reward), preset {args.preset}, N={args.nproc} ranks, G={args.group}, "
            f"{args.prompts} prompts x {args.samples} samples x {args.max_tokens} tokens, "
            f"{args.steps} steps ({args.steps - 1} timed after the first), {args.jobs} jobs "
            f"per placement.\n\n{table}\n")
    path = _common.result_path(args.out_dir, "placement", quick=args.quick)
    path.write_text(body)
    print(table)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
