"""In-flight weight updates (`async_rollout.inflight_updates`): a sync's
install taken between two engine steps of a running batch.

References: the same batch sampled without an install (its tokens before the
install must be exactly these), the new weights' own prefill log-probs (the
tokens after it), and the gate's contract with recording fakes (who installs,
when, with running requests or not)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from hybrid_engine.config import RunConfig, apply_overrides
from hybrid_engine.policy.inflight import InstallGate
from hybrid_engine.testing import run_in_subprocess
from hybrid_engine.trajectory import Trajectory, stamp_version
from tests.rollout.test_partial import _score

# --- the gate (no engine) ---------------------------------------------------------


class _Commit:
    """A fake engine install: records the thread and the running flag."""

    def __init__(self, fail: bool = False) -> None:
        self.calls: list[tuple[str, bool]] = []
        self.fail = fail

    def __call__(self, *, running: bool) -> float:
        self.calls.append((threading.current_thread().name, running))
        if self.fail:
            raise RuntimeError("install failed")
        return 0.25


def _batch(gate: InstallGate, steps: int, seen: list, start: threading.Event,
           delay: float = 0.01) -> list[int]:
    """A fake generation: `steps` engine steps with a boundary after each but
    the last; returns the install count of each step's tokens."""
    done, out = 0, []
    start.set()
    for i in range(steps):
        time.sleep(delay)
        out.append(done)
        if i < steps - 1 and gate.between_steps():
            done += 1
            seen.append(i)
    return out


def test_an_offer_is_taken_at_the_next_boundary_of_the_running_batch() -> None:
    gate, commit, seen, start = InstallGate(), _Commit(), [], threading.Event()
    with ThreadPoolExecutor(1, thread_name_prefix="generation") as pool:
        batch = pool.submit(_batch, gate, 200, seen, start)
        start.wait()
        repack, landed = gate.hand_over(commit, [batch])
        installs = batch.result()
    assert (repack, landed) == (0.25, True)
    assert commit.calls == [(commit.calls[0][0], True)]  # once, preempting running requests
    assert commit.calls[0][0].startswith("generation")
    assert gate.inflight_installs == 1 and len(seen) == 1
    # tokens before the boundary count 0 installs, every one after it 1
    assert installs == [0] * (seen[0] + 1) + [1] * (199 - seen[0])


def test_with_no_batch_running_the_sync_thread_installs_at_once() -> None:
    gate, commit = InstallGate(), _Commit()
    ended: Future = Future()
    ended.set_result(None)
    assert gate.hand_over(commit, [ended]) == (0.25, False)
    assert gate.hand_over(commit, []) == (0.25, False)
    assert [r for _, r in commit.calls] == [False, False]
    assert gate.between_steps() is False  # the offer was withdrawn: nothing left to take


def test_an_offer_the_tp_group_does_not_agree_on_waits_for_the_batch() -> None:
    """A TP peer not ready yet (agree -> False at every boundary): the install is
    never taken inside the batch, and lands after it, from the sync thread."""
    asked: list[bool] = []

    def agree(ready: bool) -> bool:
        asked.append(ready)
        return False

    gate, commit, seen, start = InstallGate(agree), _Commit(), [], threading.Event()
    with ThreadPoolExecutor(1, thread_name_prefix="generation") as pool:
        batch = pool.submit(_batch, gate, 30, seen, start)
        start.wait()
        assert gate.hand_over(commit, [batch]) == (0.25, False)
        assert batch.done() and batch.result() == [0] * 30
    assert seen == [] and True in asked  # this rank was ready; the group was not
    assert commit.calls == [(threading.current_thread().name, False)]


def test_a_failed_install_fails_the_batch_and_the_sync() -> None:
    gate, commit, seen, start = InstallGate(), _Commit(fail=True), [], threading.Event()
    with ThreadPoolExecutor(1, thread_name_prefix="generation") as pool:
        batch = pool.submit(_batch, gate, 200, seen, start)
        start.wait()
        with pytest.raises(RuntimeError, match="install failed"):
            gate.hand_over(commit, [batch])
        with pytest.raises(RuntimeError, match="install failed"):
            batch.result()


def test_a_batch_queued_behind_an_inflight_install_counts_it_from_its_first_token() -> None:
    """k = 2: batches 1 and 2 are submitted before sync 1 is handed over; it lands
    inside batch 1, so batch 2 samples the new weights from its first token: run
    through `InstallGate.sample` (the separate policy's batch job), its tokens
    count 1 install from the start, batch 1's 0 then 1. The gate counts installs
    taken in a batch and those the sync thread makes alike."""
    from hybrid_engine.policy.ahead import SerialWorker

    gate, commit, seen, start = InstallGate(), _Commit(), [], threading.Event()
    gen, syncs = SerialWorker("generation"), SerialWorker("sync")
    try:
        def batch(handed: int, steps: int) -> list[int]:
            def run() -> tuple[list, float]:
                inst = _batch(gate, steps, seen, start)
                return [Trajectory(prompt_ids=[1], response_ids=[5] * steps,
                                   rollout_logp=[-0.1] * steps, info={"installs": inst})], 0.5
            return gate.sample(handed, run)[0][0].info["installs"]

        b1, b2 = gen.submit(lambda: batch(0, 200)), gen.submit(lambda: batch(0, 5))
        start.wait()
        sync = syncs.submit(lambda: gate.hand_over(commit, gen.pending()))
        assert sync.result() == (0.25, True)  # taken inside batch 1
        inst1, inst2 = b1.result(), b2.result()
        assert inst1[0] == 0 and inst1[-1] == 1
        assert inst2 == [1] * 5  # no install inside it: all its tokens are v + 1
        assert gate.installed == 1
        assert gate.hand_over(commit, []) == (0.25, False)  # none running: the sync thread's
        assert gate.installed == 2
        after = gen.submit(lambda: batch(2, 3)).result()  # submitted after both: nothing to add
        assert after == [0, 0, 0]
    finally:
        gen.shutdown()
        syncs.shutdown()


def test_stamp_version_turns_install_counts_into_token_versions() -> None:
    t = Trajectory(prompt_ids=[1], response_ids=[5, 6, 7], rollout_logp=[-0.1] * 3,
                   info={"installs": [0, 0, 2]})
    plain = Trajectory(prompt_ids=[1], response_ids=[5], rollout_logp=[-0.1])
    queued = Trajectory(prompt_ids=[1], response_ids=[5, 6], rollout_logp=[-0.1] * 2,
                        info={"installs": [1, 2]})  # an install landed before it started
    stamp_version([t, plain, queued], 4)
    assert t.policy_version == 4 and t.token_versions == [4, 4, 6]
    assert queued.policy_version == 5 and queued.token_versions == [5, 6]
    assert "installs" not in t.info and plain.token_versions is None


@pytest.mark.parametrize("overrides, match", [
    (["async_rollout.inflight_updates=true", "async_rollout.max_staleness=1",
      "algorithm.behaviour_logp=rollout"], "placement=separate"),
    (["async_rollout.inflight_updates=true", "placement=separate"], "max_staleness >= 1"),
    (["async_rollout.inflight_updates=true", "placement=separate", "async_rollout.max_staleness=1",
      "algorithm.behaviour_logp=rollout", "async_rollout.schedule=burst"], "stream or auto"),
    (["async_rollout.inflight_updates=true", "placement=separate", "async_rollout.max_staleness=1",
      "algorithm.behaviour_logp=rollout", "sync.verify=true"], "sync.verify=false"),
    (["async_rollout.inflight_updates=true", "placement=separate", "async_rollout.max_staleness=1",
      "algorithm.behaviour_logp=rollout", "sync.method=naive"], "sync.method=reshard"),
])
def test_inflight_updates_settings_are_checked(overrides, match) -> None:
    with pytest.raises(ValueError, match=match):
        apply_overrides(RunConfig(), overrides)


# --- one real engine ----------------------------------------------------------------

PROMPTS = [[11, 12, 13, 14 + i] for i in range(4)]
MAX_TOKENS = 48


def _install_mid_batch(model_dir: str, other_dir: str) -> dict:
    """Samples a batch twice with the same seeds: once plainly, once with the
    other model's weights handed over (InstallGate, from a sync thread) after a
    few engine steps."""
    from safetensors.torch import load_file

    from hybrid_engine.config import MemoryConfig, RolloutConfig
    from hybrid_engine.rollout.engine import VLLMRollout

    cfg = RolloutConfig(num_samples_per_prompt=2, max_tokens=MAX_TOKENS, max_model_len=96,
                        enforce_eager=True, seed=5)
    rollout = VLLMRollout(model_dir, cfg, memory=MemoryConfig(kv_cache_gib=0.05), dtype="float32")
    plain = rollout.generate(PROMPTS, seed=1)
    gate, steps, fifth = InstallGate(rollout.tp_all), [], threading.Event()

    def boundary() -> bool:  # the engine's hook, counting steps
        steps.append(len(steps))
        if len(steps) == 5:
            fifth.set()
        return gate.between_steps()

    def commit(*, running: bool) -> float:
        rollout.load_full_weights(load_file(f"{other_dir}/model.safetensors").items())
        return rollout.commit_weights(running=running)

    with ThreadPoolExecutor(1, thread_name_prefix="generation") as pool:
        batch = pool.submit(rollout.generate, PROMPTS, seed=1, between_steps=boundary)
        batch.add_done_callback(lambda _: fifth.set())
        fifth.wait()  # 5 engine steps in (or, failing, the batch over: landed is then False)
        landed = gate.hand_over(commit, [batch])[1]
        out = batch.result()
    again = rollout.generate(PROMPTS, seed=1)  # no hook: LLM.generate, new weights
    rows = []
    for i, (toks, lps, inst) in enumerate(zip(out.token_ids, out.logprobs, out.installs,
                                              strict=True)):
        n0 = inst.count(0)
        new = _score(rollout, PROMPTS[i // 2] + toks)[len(PROMPTS[i // 2]) - 1:]
        rows.append({
            "installs": inst, "n0": n0,
            "prefix_equal": (toks[:n0], lps[:n0]) == (plain.token_ids[i][:n0],
                                                      plain.logprobs[i][:n0]),
            "cont_vs_new": max((abs(a - b) for a, b in zip(lps[n0:], new[n0:])), default=0.0),
            "prefix_vs_new": max((abs(a - b) for a, b in zip(lps[:n0], new[:n0])), default=0.0),
        })
    # the step loop without installs = LLM.generate
    looped = rollout.generate(PROMPTS, seed=1, between_steps=lambda: False)
    rollout.shutdown()
    return {"landed": landed, "rows": rows, "plain_installs": plain.installs,
            "looped_equal": (looped.token_ids, looped.logprobs) == (again.token_ids,
                                                                     again.logprobs),
            "looped_installs": looped.installs}


@pytest.mark.vllm
@pytest.mark.slow
def test_an_install_between_engine_steps_switches_the_weights_mid_sequence(two_models):
    out = run_in_subprocess(_install_mid_batch, *two_models, timeout=300)
    assert out["landed"], out  # taken inside the batch, not after it
    assert out["plain_installs"] is None  # without the hook: LLM.generate, no counts
    mixed = [r for r in out["rows"] if 0 < r["n0"] < len(r["installs"])]
    assert mixed, out  # sequences running across the install
    for r in out["rows"]:
        assert r["installs"] == sorted(r["installs"]) and set(r["installs"]) <= {0, 1}
        assert r["prefix_equal"], r  # before the install: exactly the old weights' samples
        assert r["cont_vs_new"] < 1e-3, r  # after it: the new weights' engine (KV recomputed)
    for r in mixed:
        assert r["prefix_vs_new"] > 1e-2, r  # (the two models do differ on the prefix)
    # The hand-driven loop samples what LLM.generate samples (same seeds, same steps).
    assert out["looped_equal"] and all(set(i) == {0} for i in out["looped_installs"])


def _tp_agreement(model_dir: str) -> dict:
    """TP = 2 over 2 ranks: rank 0's sync offers its install after 2 engine steps,
    rank 1's after 10; returns the boundary where this rank installed."""
    import torch.distributed as dist

    from hybrid_engine.config import MemoryConfig, RolloutConfig
    from hybrid_engine.rollout.engine import VLLMRollout

    cfg = RolloutConfig(tensor_parallel_size=2, num_samples_per_prompt=2, max_tokens=MAX_TOKENS,
                        max_model_len=96, enforce_eager=True, seed=5)
    rollout = VLLMRollout(model_dir, cfg, memory=MemoryConfig(kv_cache_gib=0.05), dtype="float32")
    gate, steps, at = InstallGate(rollout.tp_all), [], []
    offer_after = 2 if dist.get_rank() == 0 else 10
    ready = threading.Event()  # this rank's sync may offer: offer_after steps in, or the batch over

    def boundary() -> bool:
        steps.append(len(steps))
        if len(steps) == offer_after:
            ready.set()
        return gate.between_steps()

    def commit(*, running: bool) -> float:
        at.append((len(steps), running))
        return rollout.commit_weights(running=running)

    started: Future = Future()  # the batch, as the sync thread sees it

    def sync() -> bool:
        ready.wait()
        return gate.hand_over(commit, [started])[1]

    # Here the engine runs on the main thread and the sync on a side thread (the
    # gate does not mind which is which): under run_ranks a new thread's OpenMP
    # default is the machine's cores, not the rank's share vLLM bound, and the CPU
    # attention kernel checks the two agree (torchrun sets OMP_NUM_THREADS first).
    with ThreadPoolExecutor(1, thread_name_prefix="sync") as pool:
        landed = pool.submit(sync)
        out = rollout.generate(PROMPTS, seed=1, between_steps=boundary)
        started.set_result(None)
        ready.set()
        landed = landed.result()
    rollout.shutdown()
    return {"at": at, "landed": landed, "steps": len(steps), "tokens": out.token_ids,
            "installs": out.installs}


@pytest.mark.vllm
@pytest.mark.slow
def test_tensor_parallel_ranks_install_at_the_same_engine_step(two_models):
    """Each rank's sync is ready at a different step; the TP group installs at one
    boundary, once both are (a rank installing alone would desynchronise the
    group's schedulers and sample from half-old, half-new shards)."""
    from hybrid_engine.testing import run_ranks

    r0, r1 = run_ranks(_tp_agreement, 2, two_models[0], timeout=400)
    assert r0["landed"] and r1["landed"], (r0, r1)
    assert r0["at"] == r1["at"] and len(r0["at"]) == 1
    (step, running), = r0["at"]
    assert running and 10 <= step < r0["steps"]  # not before the later rank was ready
    assert r0["tokens"] == r1["tokens"] and r0["installs"] == r1["installs"]


# --- a whole run under torchrun -----------------------------------------------------


@pytest.mark.vllm
@pytest.mark.slow
def test_a_separate_run_installs_inside_batches_and_resumes(model_dir, reward_file,
                                                            tmp_path) -> None:
    """1 trainer + 1 rollout rank, k = 1, 64-token completions (generation ~2x the
    tiny model's train step, so the sync after a step lands while the next
    batch is sampled): the installs happen between engine steps, the tokens
    after them carry the newer version, and a resume from the checkpoint runs
    on (timing-dependent: not the straight run's samples)."""
    import json

    from tests.policy.runs import rows, train

    out = tmp_path / "run"
    args = ("--rollout.tensor_parallel_size=1", "--algorithm.behaviour_logp=rollout",
            "--placement=separate", "--rollout.num_ranks=1", "--async_rollout.max_staleness=1",
            "--sync.verify=false", "--async_rollout.inflight_updates=true",
            "--rollout.max_tokens=64", "--rollout.max_model_len=128", "--train.num_steps=5",
            "--checkpoint_every=3")
    train(model_dir, reward_file, out, 2, *args)
    r = [x for x in rows(out) if "train_s" in x]
    assert [x["step"] for x in r] == [1, 2, 3, 4, 5]
    inflight = [x for x in r if x.get("sync_inflight") == 1.0]
    assert inflight, r  # installed inside a running batch (the knob acts)
    assert any(x["newer_weights_token_frac"] > 0 for x in inflight)
    for x in r:
        assert x["staleness_max"] <= 1 and 0 <= x["staleness_token_mean"] <= x["staleness_mean"]
    ckpt = json.loads(sorted((out / "checkpoints").glob("*/meta.json"))[-1].read_text())
    (ahead,) = ckpt["extra"]["ahead"]
    for t in ahead["trajs"]:  # k = 1: at most one sync lands while a batch is sampled
        inst = t["info"]["installs"]
        assert inst == sorted(inst) and set(inst) <= {0, 1} and len(inst) == len(t["response_ids"])
    train(model_dir, reward_file, out, 2, *args, "--resume")
    resumed = [x for x in rows(out) if "train_s" in x]
    assert [x["step"] for x in resumed] == [1, 2, 3, 4, 5]
    assert resumed[:3] == r[:3]  # the steps before the checkpoint are kept as they were
