"""Multi-turn episodes that advance independently: no turn waits for the slowest episode.

Job: `collect_per_episode(rollout, env, prompt_ids, k, seed, stops)` samples
the same episodes as `episodes`' turn loop, but each episode's next turn
enters vLLM's engine as soon as the environment has answered its last one,
while the other episodes keep decoding (`VLLMRollout.open_run`: requests
added between engine steps). Environment steps run off the engine's thread:
many at once for `concurrent_steps` environments (tools of many episodes
together), else one at a time.

Replicas: replica r runs the episodes of its contiguous slice of the prompts
on its own engine; its trajectories are all-gathered at the end (one
collective per call, none per engine step; a replica that finishes first
waits there, within the job's collective timeout). Within a tensor-parallel
group every rank must add the same requests at the same engine step, so only
the group's first rank (the leader) runs the environment; before every
engine step it broadcasts the requests to add (a 2-int header, and one int64
tensor when it admits any; the time is `broadcast_s`), and the other ranks
mirror the engine. At the end every rank's sampled tokens are compared with
its leader's (a digest): a difference is a RuntimeError. An error on a
leader reaches its followers (an abort header) and, through the gather,
every rank, which all raise.

Seeds: a turn's request has the seed the turn loop gives it
(`episode_record.request_seed`), so under fixed seeds both loops sample the
same tokens wherever vLLM's numerics do not depend on the batch. Which
requests share an engine step depends on when tools return, so log-probs
agree with the turn loop's (and between runs) to float noise only.

Invariant: the trajectories are those `finish` checks (context, loss_mask,
log-probs), prompt-major, the same list on every rank.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

from hybrid_engine.rollout.episode_record import (
    MAX_STEP_THREADS, EpisodeRecord, advance, end_when_full, finish, request_seed,
)
from hybrid_engine.trajectory import Trajectory

__all__ = ["ScheduleStats", "collect_per_episode"]

_ABORT: Any = object()  # what a follower receives when its leader failed


class _LeaderFailed(RuntimeError):
    """A follower's: its leader failed (the gather then says how)."""


@dataclass(slots=True)
class ScheduleStats:
    """Where one call's time went (seconds): on this rank, and after the
    per-episode loop's gather, wall and idle summed over the replicas' leaders."""

    wall_s: float = 0.0
    engine_s: float = 0.0  # inside engine steps
    idle_s: float = 0.0  # no request in the engine while episodes waited for their env
    broadcast_s: float = 0.0  # the leader's per-step decisions to its TP group
    engine_steps: int = 0

    def merged(self, other: ScheduleStats) -> ScheduleStats:
        """The two calls' times together (rounds of one step)."""
        return ScheduleStats(*(getattr(self, f) + getattr(other, f) for f in (
            "wall_s", "engine_s", "idle_s", "broadcast_s", "engine_steps")))

    @property
    def idle_fraction(self) -> float:
        return self.idle_s / self.wall_s if self.wall_s > 0 else 0.0


@dataclass(slots=True)
class _Request:
    """A turn to sample: what the leader broadcasts (plain data)."""

    episode: int  # index among this replica's episodes
    context: list[int]
    max_tokens: int
    seed: int
    logprobs: bool


@dataclass
class _Leader:
    """The leader's state: episodes, requests in the engine, env steps running."""

    env: Any
    episodes: list[EpisodeRecord]
    keys: list[int]  # each episode's index in the whole call (its seed key)
    max_model_len: int
    max_tokens: int
    engine_seed: int
    seed: int
    later_logprobs: bool  # turns after the first: one sample each, as the turn loop asks
    in_engine: dict[int, _Request] = field(default_factory=dict)  # by request index
    stepping: dict[Future, int] = field(default_factory=dict)  # env step -> episode
    ready: list[_Request] = field(default_factory=list)

    def next_turn(self, e: int) -> None:
        """Queues episode e's next request, or ends it when its context is full."""
        ep = self.episodes[e]
        room = self.max_model_len - len(ep.context)
        if room < 1:
            end_when_full(self.env, ep)
            return
        self.ready.append(_Request(e, list(ep.context), min(self.max_tokens, room), request_seed(
            self.engine_seed, self.seed, ep.num_segments, self.keys[e]), self.later_logprobs))

    def settle(self, done: set[Future]) -> None:
        """Records finished env steps; queues the next turn of episodes still running."""
        for future in sorted(done, key=self.stepping.__getitem__):  # in episode order
            e = self.stepping.pop(future)
            if future.result():
                self.next_turn(e)


def collect_per_episode(rollout: Any, env: Any, prompt_ids: list[list[int]], k: int, seed: int,
                        stops: Sequence[str], stats: ScheduleStats | None = None,
                        ) -> list[Trajectory]:
    """len(prompt_ids) * k trajectories, prompt-major (as `episodes.collect`);
    collective over the rollout's world. stats, when given, is filled in."""
    stats = stats if stats is not None else ScheduleStats()
    start = time.perf_counter()
    prompts = rollout.prompt_ids(prompt_ids)  # rollout.prompt_too_long applied
    replica, num_replicas = rollout.replica()
    lo, hi = (len(prompts) * i // num_replicas for i in (replica, replica + 1))
    run = rollout.open_run("episode")
    tp = rollout.cfg.tensor_parallel_size
    lead = tp == 1 or _tp_rank() == 0
    trajs: list[Trajectory] | None = None
    error: Exception | None = None
    try:
        if lead:
            trajs = _run_leader(rollout, env, run, prompts, range(lo, hi), k, seed, stops, stats)
        else:
            _run_follower(rollout, run, stops, stats)
    except Exception as e:  # every rank learns of it in the gather, and raises
        run.abort_unfinished()  # nothing of this call stays in the engine
        if lead and tp > 1:
            _broadcast(rollout, None, stats, abort=True)  # the followers stop waiting
        error = e
    except BaseException:
        run.abort_unfinished()
        raise
    digest = hashlib.blake2b(repr(run.tokens).encode(), digest_size=16).hexdigest()
    stats.wall_s = time.perf_counter() - start
    return _gather(rollout, replica, digest, trajs, stats, error)


def _run_leader(rollout: Any, env: Any, run: Any, prompts: list[list[int]], mine: range, k: int,
                seed: int, stops: Sequence[str], stats: ScheduleStats) -> list[Trajectory]:
    cfg = rollout.cfg
    keys = [p * k + j for p in mine for j in range(k)]
    leader = _Leader(env, [], keys, cfg.max_model_len, cfg.max_tokens, cfg.seed, seed,
                     rollout.wants_logprobs(0))
    for p in mine:
        for j in range(k):
            leader.episodes.append(EpisodeRecord(state=env.reset(prompts[p]), group_id=p,
                                                 context=list(prompts[p]),
                                                 prompt_len=len(prompts[p])))
            leader.ready.append(_Request(len(leader.episodes) - 1, list(prompts[p]),
                                         cfg.max_tokens, request_seed(cfg.seed, seed, 0, p, j),
                                         rollout.wants_logprobs(j)))
    # Steps off the engine's thread: at once when the env allows it, else one at a time.
    threads = min(len(keys), MAX_STEP_THREADS) if getattr(env, "concurrent_steps", False) else 1
    pool = ThreadPoolExecutor(max_workers=max(threads, 1), thread_name_prefix="env-step")
    try:
        _lead(leader, rollout, run, pool, stops, stats)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)  # on an error: queued steps never run
    trajs = [finish(env, ep) for ep in leader.episodes]
    _broadcast(rollout, None, stats)  # the followers' loop ends
    return trajs


def _lead(leader: _Leader, rollout: Any, run: Any, pool: ThreadPoolExecutor,
          stops: Sequence[str], stats: ScheduleStats) -> None:
    """The leader's loop: admit what is ready, step the engine, hand finished turns
    to the env, until every episode is done."""
    while leader.ready or leader.in_engine or leader.stepping:
        if not leader.ready and not leader.in_engine:  # the engine waits for the env
            t = time.perf_counter()
            done, _ = wait(leader.stepping, return_when=FIRST_COMPLETED)
            stats.idle_s += time.perf_counter() - t
            leader.settle(done)
            continue
        admitted, leader.ready = leader.ready, []
        _broadcast(rollout, admitted, stats)
        for i, r in zip(_add(rollout, run, admitted, stops), admitted, strict=True):
            leader.in_engine[i] = r
        for i in _step(run, stats):
            r = leader.in_engine.pop(i)
            segment, logp = list(run.tokens[i]), list(run.logps[i])
            if r.logprobs and any(math.isnan(x) for x in logp):
                raise RuntimeError("sampled tokens have NaN log-probs: vLLM's weights are not "
                                   "valid")
            future = pool.submit(advance, leader.env, leader.episodes[r.episode], segment, logp)
            leader.stepping[future] = r.episode
        leader.settle({f for f in leader.stepping if f.done()})


def _run_follower(rollout: Any, run: Any, stops: Sequence[str], stats: ScheduleStats) -> None:
    """A TP rank after the first: adds what the leader admits, steps with it."""
    while (admitted := _broadcast(rollout, None, stats, receive=True)) is not None:
        if admitted is _ABORT:
            raise _LeaderFailed("the first rank of this tensor-parallel group failed")
        _add(rollout, run, admitted, stops)
        _step(run, stats)


def _add(rollout: Any, run: Any, requests: list[_Request], stops: Sequence[str]) -> list[int]:
    from vllm import TokensPrompt

    params = [rollout.sampling_params(r.max_tokens, r.seed, logprobs=r.logprobs, stop=stops,
                                      include_stop_str=True) for r in requests]
    return run.add([TokensPrompt(prompt_token_ids=r.context) for r in requests], params)


def _step(run: Any, stats: ScheduleStats) -> list[int]:
    """One engine step; the requests it finished."""
    t = time.perf_counter()
    advanced = run.step()
    stats.engine_s += time.perf_counter() - t
    stats.engine_steps += 1
    return [i for i, _ in advanced if run.finished[i]]


def _tp_rank() -> int:
    import torch.distributed as dist

    from hybrid_engine.rollout import vllm_compat

    return dist.get_rank(group=vllm_compat.tp_cpu_group())


def _broadcast(rollout: Any, admitted: list[_Request] | None, stats: ScheduleStats,
               receive: bool = False, abort: bool = False) -> list[_Request] | None:
    """The leader's admissions to its TP group (None: the loop ends; `_ABORT`: the
    leader failed); at TP 1, nothing. A header tensor (count, payload length;
    count -1 = end, -2 = abort), then, when requests are admitted, one int64
    tensor of them: one collective per engine step that admits nothing."""
    if rollout.cfg.tensor_parallel_size == 1:
        return admitted
    import torch
    import torch.distributed as dist

    from hybrid_engine.rollout import vllm_compat

    group = vllm_compat.tp_cpu_group()
    t = time.perf_counter()
    payload = None if receive or abort else _pack(admitted)
    if receive:
        header = torch.zeros(2, dtype=torch.int64)
    else:
        header = torch.tensor([-2 if abort else -1, 0] if payload is None
                              else [len(admitted), payload.numel()])
    dist.broadcast(header, group_src=0, group=group)
    count, size = header.tolist()
    if count > 0:
        payload = payload if payload is not None else torch.empty(size, dtype=torch.int64)
        dist.broadcast(payload, group_src=0, group=group)
    stats.broadcast_s += time.perf_counter() - t
    if count < 0:
        return _ABORT if count == -2 else None
    if not receive:
        return admitted
    return _unpack(payload, count) if count else []


def _pack(requests: list[_Request] | None) -> Any:
    """Requests as one int64 tensor: per request episode, max_tokens, seed,
    logprobs, context length, then the context (None: the end)."""
    import torch

    if requests is None:
        return None
    flat: list[int] = []
    for r in requests:
        flat += [r.episode, r.max_tokens, r.seed, int(r.logprobs), len(r.context), *r.context]
    return torch.tensor(flat, dtype=torch.int64)


def _unpack(payload: Any, count: int) -> list[_Request]:
    flat, out, i = payload.tolist(), [], 0
    for _ in range(count):
        episode, max_tokens, seed, logprobs, n = flat[i:i + 5]
        out.append(_Request(episode, flat[i + 5:i + 5 + n], max_tokens, seed, bool(logprobs)))
        i += 5 + n
    return out


def _gather(rollout: Any, replica: int, digest: str, trajs: list[Trajectory] | None,
            stats: ScheduleStats, error: Exception | None) -> list[Trajectory]:
    """Every replica leader's trajectories on every rank, in replica order; checks
    that each TP rank sampled what its leader did. An error on any rank raises on
    every rank (the failing one's own exception there). stats' idle and wall
    time become the leaders' sums (one idle_fraction on every rank)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        if error is not None:
            raise error
        return trajs or []
    ranks = rollout.ranks if rollout.ranks is not None else list(range(dist.get_world_size()))
    out: list[Any] = [None] * len(ranks)
    own = None if isinstance(error, _LeaderFailed) else error  # a leader's is the cause
    why = None if own is None else f"{type(own).__name__}: {own}"
    dist.all_gather_object(out, (replica, digest, trajs, stats.idle_s, stats.wall_s, why),
                           group=rollout.group)
    if own is not None:
        raise own
    failed = [(rank, o[5]) for rank, o in zip(ranks, out, strict=True) if o[5] is not None]
    if failed:
        raise RuntimeError(f"rank {failed[0][0]} failed in the per-episode loop: {failed[0][1]}")
    leaders = {o[0]: o for o in out if o[2] is not None}
    if any(o[1] != leaders[o[0]][1] for o in out):
        raise RuntimeError("the ranks of a tensor-parallel group sampled different tokens "
                           "in the per-episode loop")
    stats.idle_s = sum(o[3] for o in leaders.values())
    stats.wall_s = sum(o[4] for o in leaders.values())
    return [t for o in sorted(leaders.values(), key=lambda o: o[0]) for t in o[2]]
