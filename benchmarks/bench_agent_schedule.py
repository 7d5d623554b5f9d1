"""Multi-turn episodes with tools: per-episode scheduling against the turn loop.

One workload, two loops (`rollout.schedule`), on N CPU ranks (vLLM TP = T:
T = 1, the default, is N engines each running its own share of the episodes;
T = N is one engine whose ranks must add requests in lockstep):

- turn: one `generate` per turn over the episodes still running; the turn's
  tool calls run together (threads) before the next turn starts, so every
  turn waits for the batch's slowest generation and slowest tool;
- episode: each episode's next turn enters the engine as soon as its own
  tool returns, while the others keep decoding (`rollout/agent_loop.py`);
  with T > 1 the TP group's first rank decides what enters at each engine
  step and broadcasts it.

Workload (`SleepyToolEnv`): P prompts x K episodes, each with a number of
turns drawn uniformly from 1..--max-turns (fixed by the episode's index, so
the same in both loops); after every turn but the last a "tool" sleeps a
time drawn uniformly from 0..--tool-ms (fixed by episode and turn) and
answers with a few tokens. The model is a random tiny preset; a segment ends
at a lowercase letter (about 1 in 10 of the model's draws) or at
--max-tokens, so segment lengths vary as real turns do.

Replication: --jobs fresh torchrun jobs; in each, after one warm-up of each
loop, --repeats pairs (turn then episode, the order alternating), each on
its own seed. Wall time = the slowest rank's. Headline: turn / episode wall
time (medians of all repeats) with a paired hierarchical bootstrap 95% CI
(`_stats.ratio_ci`). Also: the engine's idle fraction (time no request was
in the engine while episodes waited for tools; for the turn loop, time
outside generate), the leader's broadcast time, and checks: the trajectories
are identical on every rank, and each pair's token ids agree between the
loops (per-request seeds; the batches differ, so log-probs agree to float
noise only).

Floor: the critical path with an infinitely fast engine is the episode with
the largest sum of tool times; it is reported as `tool_floor_s`.

Prints a table; the last stdout line is JSON. Results go to
benchmarks/results/agent_schedule_<device>_tp<T>_<yyyymm>.md.

    python benchmarks/bench_agent_schedule.py            # 3 jobs x 4 pairs, N=2, T=1 (~2 min)
    python benchmarks/bench_agent_schedule.py --tp 2     # one TP-2 engine
    python benchmarks/bench_agent_schedule.py --quick    # 1 job x 2 pairs (~1 min)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCHEDULES = ("turn", "episode")
STOP_CHARS = tuple("abcdefghijklmnopqrstuvwxyz")


def _args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=2, help="ranks N")
    p.add_argument("--tp", type=int, default=1,
                   help="rollout TP size T (1, the default: N replicas; N: one engine)")
    p.add_argument("--num-prompts", type=int, default=16, help="prompts P")
    p.add_argument("--num-samples", type=int, default=4, help="episodes per prompt K")
    p.add_argument("--max-turns", type=int, default=8, help="turns per episode: 1..this")
    p.add_argument("--tool-ms", type=float, default=200.0, help="tool time: 0..this ms")
    p.add_argument("--max-tokens", type=int, default=32, help="most new tokens per turn")
    p.add_argument("--jobs", type=int, default=3, help="fresh torchrun jobs")
    p.add_argument("--repeats", type=int, default=4, help="(turn, episode) pairs per job")
    p.add_argument("--quick", action="store_true", help="1 job x 2 pairs")
    p.add_argument("--out-dir", default=str(REPO / "benchmarks" / "results"))
    p.add_argument("--cache-dir", default=str(REPO / ".cache" / "bench_models"))
    p.add_argument("--_rank-job", dest="rank_job", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:  # an explicit --repeats still counts
        args.jobs, args.repeats = 1, min(args.repeats, 2)
    for name in ("nproc", "num_prompts", "num_samples", "max_turns", "max_tokens", "jobs",
                 "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.tool_ms < 0:
        p.error("--tool-ms must be >= 0")
    return args


def _draw(*key: object) -> float:
    """A uniform [0, 1) draw fixed by key (the same on every rank and run)."""
    digest = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64


class SleepyToolEnv:
    """A multi-turn environment (`rollout.episodes`' protocol) whose turns are
    answered by a tool that sleeps: episode e (sample j of its prompt) takes
    1 + floor(draw(e) * max_turns) turns; the tool after turn t sleeps
    draw(e, t) * tool_ms (draws fixed by prompt, sample and turn, so the
    same whichever rank or loop runs the episode)."""

    turn_stop = STOP_CHARS
    concurrent_steps = True  # the tools of different episodes sleep at once

    def __init__(self, reply_ids: list[int], max_turns: int, tool_ms: float) -> None:
        self.reply_ids, self.max_turns, self.tool_ms = reply_ids, max_turns, tool_ms
        self._resets: dict[tuple, int] = {}

    def reset(self, prompt_ids):  # noqa: ANN001, ANN201
        j = self._resets.get(tuple(prompt_ids), 0)
        self._resets[tuple(prompt_ids)] = j + 1
        e = (tuple(prompt_ids), j)
        turns = 1 + int(_draw("turns", e) * self.max_turns)
        return {"episode": e, "turns": turns, "prompt": list(prompt_ids), "response": [],
                "mask": [], "done_turns": 0, "tool_s": 0.0}

    def step(self, state, segment):  # noqa: ANN001, ANN201
        segment = list(segment)
        state["response"] += segment
        state["mask"] += [True] * len(segment)
        state["done_turns"] += 1
        if not segment or state["done_turns"] >= state["turns"]:
            return [], True
        seconds = _draw("tool", state["episode"], state["done_turns"]) * self.tool_ms / 1000
        time.sleep(seconds)
        state["tool_s"] += seconds
        state["response"] += self.reply_ids
        state["mask"] += [False] * len(self.reply_ids)
        return list(self.reply_ids), False

    def build_trajectory(self, state, policy_logp=None, group_id=0):  # noqa: ANN001, ANN201
        from hybrid_engine.trajectory import Trajectory

        it = iter(policy_logp or [])
        return Trajectory(prompt_ids=state["prompt"], response_ids=state["response"],
                          rollout_logp=[next(it) if m else 0.0 for m in state["mask"]],
                          loss_mask=state["mask"], group_id=group_id,
                          info={"num_turns": state["done_turns"], "tool_s": state["tool_s"]})


# --- one job, on every rank (under torchrun) -----------------------------------

def _digest(trajs, with_logp: bool) -> str:  # noqa: ANN001
    rows = [(t.prompt_ids, t.response_ids, t.loss_mask) + ((t.rollout_logp,) if with_logp else ())
            for t in trajs]
    return hashlib.sha256(json.dumps(rows).encode()).hexdigest()[:16]


def _rank_job(args: argparse.Namespace) -> None:
    import dataclasses

    import torch
    import torch.distributed as dist

    from hybrid_engine.config import MemoryConfig, RolloutConfig
    from hybrid_engine.rollout.agent_loop import ScheduleStats
    from hybrid_engine.rollout.engine import VLLMRollout
    from hybrid_engine.rollout.episodes import collect

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    base = RolloutConfig(tensor_parallel_size=args.tp, max_tokens=args.max_tokens,
                         max_model_len=512, enforce_eager=True, temperature=1.0)
    rollout = VLLMRollout(args.rank_job, base, memory=MemoryConfig(kv_cache_gib=0.5),
                          dtype="float32")
    tok = rollout.tokenizer
    reply = tok.encode("<result>42</result>", add_special_tokens=False)
    prompts = [tok.encode(f"Problem {i}: use the tool.\n", add_special_tokens=False)
               for i in range(args.num_prompts)]
    configs = {s: dataclasses.replace(base, schedule=s) for s in SCHEDULES}

    def once(schedule: str, seed: int) -> dict:
        rollout.cfg = configs[schedule]
        env = SleepyToolEnv(reply, args.max_turns, args.tool_ms)
        stats = ScheduleStats()
        dist.barrier()
        t0 = time.perf_counter()
        trajs = collect(rollout, env, prompts, num_samples=args.num_samples, seed=seed,
                        stats=stats)
        t = torch.tensor([time.perf_counter() - t0])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        every: list = [None] * world
        dist.all_gather_object(every, _digest(trajs, with_logp=True))
        return {"wall_s": t.item(), "idle_fraction": stats.idle_fraction,
                "engine_s": stats.engine_s, "broadcast_s": stats.broadcast_s,
                "engine_steps": stats.engine_steps, "same_on_all_ranks": len(set(every)) == 1,
                "tokens": _digest(trajs, with_logp=False),
                "sampled": sum(sum(t_.loss_mask) for t_ in trajs),
                "turns": sum(t_.info["num_turns"] for t_ in trajs),
                "tool_floor_s": max(t_.info["tool_s"] for t_ in trajs)}

    once("turn", 10_000)  # warm-up, both loops
    once("episode", 10_000)
    rows = []
    for i in range(args.repeats):
        order = SCHEDULES if i % 2 == 0 else SCHEDULES[::-1]
        pair = {s: once(s, seed=i) for s in order}
        rows.append(pair)
    if rank == 0:
        print(json.dumps({"rows": rows, "world": world, "tp": base.tensor_parallel_size}),
              flush=True)
    rollout.shutdown()
    if dist.is_initialized():
        dist.destroy_process_group()


# --- driver ---------------------------------------------------------------------

def _job(args: argparse.Namespace, model: Path, logs: Path) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={args.nproc}", __file__, "--_rank-job", str(model),
           f"--num-prompts={args.num_prompts}", f"--num-samples={args.num_samples}",
           f"--max-turns={args.max_turns}", f"--tool-ms={args.tool_ms}",
           f"--max-tokens={args.max_tokens}", f"--repeats={args.repeats}", f"--tp={args.tp}"]
    log = logs / f"job-{time.monotonic_ns()}.log"
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // args.nproc))}
    with open(log, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env,
                            timeout=1200).returncode
    lines = [ln for ln in log.read_text().splitlines() if ln.startswith("{")]
    if rc != 0 or not lines:
        errors = [ln for ln in log.read_text().splitlines() if "Error" in ln]
        sys.stderr.write("\n".join(errors[:10]) + "\n")
        raise SystemExit(f"bench job failed (exit {rc}); its log: {log}")
    return json.loads(lines[-1])


def _model(args: argparse.Namespace) -> Path:
    from dataclasses import replace

    from hybrid_engine.models.tiny import PRESETS, write_tiny_model
    from hybrid_engine.models.tokenizer import TOKENIZER_VOCAB_SIZE

    folder = Path(args.cache_dir) / "tiny-bytevocab"
    if not (folder / "config.json").is_file():  # vocabulary = the byte tokenizer's
        write_tiny_model(folder, replace(PRESETS["tiny"], vocab_size=TOKENIZER_VOCAB_SIZE))
    return folder


def main(argv=None) -> None:
    args = _args(argv)
    if args.rank_job:
        _rank_job(args)
        return
    from _common import result_header, result_path
    from _stats import describe, ratio, ratio_ci

    model = _model(args)
    jobs, logs = [], Path(tempfile.mkdtemp(prefix="agent_schedule-"))
    for j in range(args.jobs):
        jobs.append(_job(args, model, logs))
        print(f"[agent_schedule] job {j + 1}/{args.jobs} done", file=sys.stderr, flush=True)
    shutil.rmtree(logs)  # kept when a job fails
    walls = {s: [[r[s]["wall_s"] for r in job["rows"]] for job in jobs] for s in SCHEDULES}
    rows = [r for job in jobs for r in job["rows"]]
    summary = {
        "speedup": ratio(walls["turn"], walls["episode"]),
        "speedup_ci95": ratio_ci(walls["turn"], walls["episode"]),
        **{f"{s}_wall_s": describe(walls[s]) for s in SCHEDULES},
        **{f"{s}_idle_fraction": statistics.median(r[s]["idle_fraction"] for r in rows)
           for s in SCHEDULES},
        "episode_broadcast_s": statistics.median(r["episode"]["broadcast_s"] for r in rows),
        "episode_engine_steps": statistics.median(r["episode"]["engine_steps"] for r in rows),
        "tool_floor_s": statistics.median(r["turn"]["tool_floor_s"] for r in rows),
        "same_on_all_ranks": all(r[s]["same_on_all_ranks"] for r in rows for s in SCHEDULES),
        "tokens_equal_between_loops": sum(r["turn"]["tokens"] == r["episode"]["tokens"]
                                          for r in rows),
        "pairs": len(rows), "world": jobs[0]["world"], "tp": jobs[0]["tp"],
        "sampled_tokens": statistics.median(r["turn"]["sampled"] for r in rows),
        "turns": statistics.median(r["turn"]["turns"] for r in rows),
    }
    _report(args, summary, jobs, result_header, result_path)


def _report(args, summary: dict, jobs: list, result_header, result_path) -> None:  # noqa: ANN001
    table = ["| loop | wall s median [IQR] | engine idle | |", "|---|---|---|---|"]
    for s in SCHEDULES:
        d = summary[f"{s}_wall_s"]
        table.append(f"| {s} | {d['median']:.2f} [{d['q1']:.2f}, {d['q3']:.2f}] | "
                     f"{summary[f'{s}_idle_fraction']:.0%} | n={d['n']} |")
    lo, hi = summary["speedup_ci95"]
    text = "\n".join([
        *table, "",
        f"turn / episode wall time: **{summary['speedup']:.2f}x** (95% CI {lo:.2f}-{hi:.2f}, "
        f"{args.jobs} jobs x {args.repeats} pairs). Floor: with an infinitely fast engine the "
        f"episode loop takes the longest episode's tool time, {summary['tool_floor_s']:.2f} s.",
        f"Workload: {args.num_prompts} prompts x {args.num_samples} episodes, 1-{args.max_turns} "
        f"turns (median {summary['turns']} turns, {summary['sampled_tokens']} sampled tokens "
        f"per call), tools 0-{args.tool_ms:.0f} ms, <= {args.max_tokens} tokens per turn; "
        f"N={summary['world']}, T={summary['tp']}.",
        f"Per-step broadcast of the leader's decisions (episode loop): median "
        f"{summary['episode_broadcast_s']:.3f} s over {summary['episode_engine_steps']:.0f} "
        f"engine steps per call.",
        f"Same trajectories on every rank: {summary['same_on_all_ranks']}. Token ids equal "
        f"between the loops in {summary['tokens_equal_between_loops']} of {summary['pairs']} "
        f"pairs.",
    ])
    print(text)
    path = result_path(args.out_dir, "agent_schedule", tag=f"_tp{args.tp}", quick=args.quick)
    path.write_text(result_header(__file__, None) + text + "\n\n```json\n"
                    + json.dumps({"summary": summary, "jobs": jobs}, indent=1) + "\n```\n")
    print(json.dumps({"result": str(path), **summary}))


if __name__ == "__main__":
    main()
