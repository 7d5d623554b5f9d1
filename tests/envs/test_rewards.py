"""env.rewards: weighted terms (built-in math and format, the env's own task reward,
user functions per sample or batched), the reward pool's timeouts that kill a
stuck call, and every way a term can fail, as a RewardError naming the term and
the sample. In-process, one rank (two ranks scoring once each: the end-to-end
run in tests/envs/test_real_task.py)."""

from __future__ import annotations

import json
import math
import time

import psutil
import pytest

from hybrid_engine.config import EnvConfig
from hybrid_engine.envs import make_env
from hybrid_engine.envs.base import RewardError
from hybrid_engine.envs.rewards import parse_rewards
from hybrid_engine.metrics import trajectory_metrics
from hybrid_engine.models.tokenizer import build_tokenizer
from hybrid_engine.trajectory import Trajectory

TOK = build_tokenizer()

_SOURCE = """
import os, sys, time

def length(prompt, completion, answer):
    return float(len(completion))

def parts(prompt, completion, answer, level):
    return {"level": float(level), "has_answer": float(answer is not None)}

def everything(prompt, completion, answer, **cols):
    return float(len(cols))

def batch(prompts, completions, answers, level):
    with open(os.environ["HE_TEST_CALLS"], "a") as f:
        f.write(f"{len(prompts)}\\n")
    return [float(l) * 10 for l in level]

def short_batch(prompts, completions, answers):
    return [1.0]

def hangs(prompt, completion, answer):
    time.sleep(3600)

def slow(prompt, completion, answer):
    time.sleep(0.4)
    return 1.0

def hangs_on_7(prompt, completion, answer):
    if prompt.startswith("7+"):
        time.sleep(3600)
    return 1.0

def exits(prompt, completion, answer):
    sys.exit(3)

def raises(prompt, completion, answer):
    return 1 / 0

def nan(prompt, completion, answer):
    return float("nan")

def inf(prompt, completion, answer):
    return {"correct": float("inf")}

def word(prompt, completion, answer):
    return "high"
"""


_FUNCTIONS = {ln[4:].split("(")[0] for ln in _SOURCE.splitlines() if ln.startswith("def ")}


@pytest.fixture
def files(tmp_path):
    (tmp_path / "r.py").write_text(_SOURCE)
    rows = [{"prompt": f"{i}+{i}=", "answer": str(2 * i), "level": i % 3} for i in range(10)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp_path


def _env(files, rewards: str, **kw):  # noqa: ANN001, ANN003, ANN202
    spec = ",".join(f"{files / 'r.py'}:{t}" if t.split(":")[0] in _FUNCTIONS else t
                    for t in rewards.split(","))
    kw = {"reward_workers": 0, "reward_timeout_s": 0, **kw}
    data = str(files / "d.jsonl")
    return make_env(EnvConfig(dataset_path=data, eval_dataset_path=data, chat_template="none",
                              rewards=spec, **kw), TOK)


def _trajs(env, completions):  # noqa: ANN001, ANN202
    """One trajectory per completion, on the evaluation prompts 0+0=, 1+1=, ... in order."""
    out = []
    for prompt, text in zip(env.eval_prompts(10), completions):
        ids = TOK.encode(text).ids + [env.eos_id]
        out.append(Trajectory(prompt_ids=prompt, response_ids=ids, rollout_logp=[0.0] * len(ids),
                              loss_mask=[True] * len(ids)))
    return out


def test_terms_parse_with_weights_and_refuse_bad_specs(files) -> None:
    fn = f"{files / 'r.py'}:length"
    terms = parse_rewards(f"math:1.0, format:0.1,{fn}:0.5,task,{fn.replace('length', 'parts')}",
                          format_pattern="x")
    assert [(t.name, t.weight, t.batched) for t in terms] == [
        ("math", 1.0, False), ("format", 0.1, False), ("length", 0.5, False), ("task", 1.0, False),
        ("parts", 1.0, False)]
    assert terms[1].settings == {"pattern": "x"} and terms[4].columns == {"level"}
    assert parse_rewards(f"{files / 'r.py'}:batch")[0].batched
    for spec, needle in (("nope", "unknown reward 'nope'; the built-in ones are math, format, "
                                  "code, task, reward_model"),
                         ("math:high", "the weight of 'math' must be a number, got 'high'"),
                         (f"{fn}:x", "the weight of"),
                         ("math,,format", "an empty item"),
                         ("length:0.25", "unknown reward 'length'"),
                         ("math,math:2", "math given twice"),
                         (f"{files / 'no.py'}:f", "does not exist"),
                         (f"{files / 'r.py'}:missing", "has no function 'missing'")):
        with pytest.raises(ValueError, match=needle):
            parse_rewards(spec)


def test_the_reward_is_the_weighted_sum_and_each_part_is_logged(files) -> None:
    env = _env(files, "math:1.0,length:0.25,task:2")
    trajs = _trajs(env, ["0", "2", "wrong"])
    env.score(trajs)
    assert [t.reward_components["math"] for t in trajs] == [1.0, 1.0, 0.0]
    assert [t.reward_components["length"] for t in trajs] == [1.0, 1.0, 5.0]
    # task: the arithmetic env's own parts, correct (1.0) and format (0.1)
    assert [t.reward_components["correct"] for t in trajs] == [1.0, 1.0, 0.0]
    for t in trajs:
        c = t.reward_components
        want = 1.0 * c["math"] + 0.25 * c["length"] + 2 * (c["correct"] + c["format"])
        assert math.isclose(t.reward, want)
    m = trajectory_metrics(trajs)
    assert m["reward/math"] == pytest.approx(2 / 3) and m["accuracy"] == pytest.approx(
        sum(t.reward_components["correct"] for t in trajs) / 3)


def test_format_matches_the_whole_completion_with_the_configured_pattern(files) -> None:
    think = ["<think>a\nb</think>\n4", "4", "<think>x</think>", "<think>x</think> 4 <think>"]
    env = _env(files, "format")
    trajs = _trajs(env, think)
    env.score(trajs)
    assert [t.reward for t in trajs] == [1.0, 0.0, 0.0, 1.0]
    env = _env(files, "format", format_pattern=r"\d+")
    trajs = _trajs(env, think)
    env.score(trajs)
    assert [t.reward for t in trajs] == [0.0, 1.0, 0.0, 0.0]


def test_columns_reach_functions_per_sample_and_batched(files, tmp_path, monkeypatch) -> None:
    env = _env(files, "parts,everything")
    trajs = _trajs(env, ["x"] * 4)
    env.score(trajs)
    assert [t.reward_components["level"] for t in trajs] == [0.0, 1.0, 2.0, 0.0]
    assert {t.reward_components["has_answer"] for t in trajs} == {1.0}
    assert {t.reward_components["everything"] for t in trajs} == {1.0}  # level only
    monkeypatch.setenv("HE_TEST_CALLS", str(tmp_path / "calls"))
    env = _env(files, "batch")
    trajs = _trajs(env, ["x"] * 5)
    env.score(trajs)
    assert [t.reward for t in trajs] == [0.0, 10.0, 20.0, 0.0, 10.0]
    assert (tmp_path / "calls").read_text() == "5\n"  # one call for the whole batch


def test_a_stuck_call_is_killed_at_its_timeout_and_scores_the_timeout_value(files) -> None:
    workers_before = set(psutil.Process().children(recursive=True))
    env = _env(files, "hangs_on_7,math", reward_workers=2, reward_timeout_s=1.0,
               reward_on_timeout=-0.5)
    trajs = _trajs(env, [str(2 * i) for i in range(10)])
    t0 = time.monotonic()
    env.score(trajs)
    assert time.monotonic() - t0 < 30
    assert [t.reward_components["hangs_on_7"] for t in trajs] == [1.0] * 7 + [-0.5] + [1.0] * 2
    assert [t.info["reward_timeouts"] for t in trajs] == [0] * 7 + [1] + [0] * 2
    assert trajectory_metrics(trajs)["reward/timeouts"] == 1.0
    # math-verify's own (signal) timeouts work in a worker's main thread: math scored.
    assert {t.reward_components["math"] for t in trajs} == {1.0}
    workers = [p for p in set(psutil.Process().children(recursive=True)) - workers_before
               if "resource_tracker" not in " ".join(p.cmdline())]  # multiprocessing's own
    assert len(workers) == 2  # the killed worker was replaced
    env.close()
    gone, alive = psutil.wait_procs(list(workers), timeout=10)
    assert not alive, alive


def test_a_batch_that_stalls_times_out_together_and_warns_once(files, caplog) -> None:
    """A function that hangs on every input costs about two timeouts per batch (the
    first stall stops the running call, the second all that are left), not one per
    call (10 calls, 1 worker, 1 s: 10+ s one by one); every sample timed out is
    said once, not left to the metric."""
    env = _env(files, "hangs", reward_workers=1, reward_timeout_s=1.0, reward_on_timeout=-0.5)
    for _ in range(2):
        trajs = _trajs(env, [str(2 * i) for i in range(10)])
        t0 = time.monotonic()
        env.score(trajs)
        # two timeouts and a worker restart (a few seconds on a slow, busy machine)
        assert time.monotonic() - t0 < 8.5
        assert [t.reward for t in trajs] == [-0.5] * 10
        assert trajectory_metrics(trajs)["reward/timeouts"] == 10.0
    said = [r for r in caplog.records if "every sample of this batch (10)" in r.getMessage()]
    assert len(said) == 1, caplog.text
    env.close()


def test_a_batch_that_keeps_returning_is_not_cut(files) -> None:
    """10 calls of 0.4 s on 1 worker take 4 s, four times the 1 s timeout: each
    returns within it, so none times out."""
    env = _env(files, "slow", reward_workers=1, reward_timeout_s=1.0, reward_on_timeout=-0.5)
    trajs = _trajs(env, [str(2 * i) for i in range(10)])
    env.score(trajs)
    assert [t.reward for t in trajs] == [1.0] * 10
    env.close()


def test_batches_from_several_threads_queue_without_timing_out(files) -> None:
    """Three threads (tools of three episodes) each run 3 calls of 0.4 s on 1
    shared worker with a 0.5 s timeout: 3.6 s in all, the last batch queued behind
    the others' for 2.4 s; waiting in the queue is no stall, so none times out."""
    from concurrent.futures import ThreadPoolExecutor

    from hybrid_engine.envs.reward_pool import Call, RewardPool

    spec = f"{files / 'r.py'}:slow"
    pool = RewardPool(1, 0.5, preload=[spec])
    pool.start()
    try:
        with ThreadPoolExecutor(3) as threads:
            batches = list(threads.map(
                lambda _: pool.run([Call(spec, ("p", "c", "a"))] * 3), range(3)))
    finally:
        pool.close()
    assert [[o.kind for o in b] for b in batches] == [["ok"] * 3] * 3


def test_a_pool_first_used_from_a_thread_that_ends_keeps_its_workers(files) -> None:
    """The per-episode loop's threads call tools first: the workers they spawn
    must not die with them (PR_SET_PDEATHSIG follows the spawning thread)."""
    import threading

    from hybrid_engine.envs.reward_pool import Call, RewardPool

    spec = f"{files / 'r.py'}:slow"
    pool = RewardPool(1, 5.0, preload=[spec])
    try:
        got = []
        first = threading.Thread(target=lambda: got.append(pool.run([Call(spec, ("p", "c", "a"))])))
        first.start()
        first.join()
        time.sleep(0.5)  # the thread is gone: a worker killed with it would be by now
        got.append(pool.run([Call(spec, ("p", "c", "a"))] * 2))
    finally:
        pool.close()
    assert [[o.kind for o in b] for b in got] == [["ok"], ["ok", "ok"]]


_UNGUARDED = """
from hybrid_engine.envs.reward_pool import Call, RewardPool
print("the script's body ran", flush=True)
pool = RewardPool(2, 30.0, preload=[{spec!r}])
print([o.kind for o in pool.run([Call({spec!r}, ("p", "c", "a")) for _ in range(4)])], flush=True)
pool.close()
"""


def test_workers_do_not_run_a_script_without_a_main_guard(files, tmp_path) -> None:
    """A spawned worker would import the parent's __main__ and run its body again
    (there: start another job); the workers load only the reward functions."""
    import subprocess
    import sys

    script = tmp_path / "unguarded.py"
    script.write_text(_UNGUARDED.format(spec=f"{files / 'r.py'}:length"))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == ["the script's body ran", "['ok', 'ok', 'ok', 'ok']"], \
        proc.stdout + proc.stderr[-3000:]


@pytest.mark.parametrize(("name", "needles"), [
    ("raises", ["raised ZeroDivisionError: division by zero"]),
    ("exits", ["raised SystemExit: 3"]),
    ("nan", ["must return a finite number or a non-empty mapping of them", "nan"]),
    ("inf", ["must return a finite number", "inf"]),
    ("word", ["must return a finite number", "'high'"]),
    ("short_batch", ["a batched reward must return a list of 3 values (one per sample), got 1"]),
])
def test_a_failing_term_is_a_reward_error_naming_it_and_the_sample(files, name, needles) -> None:
    env = _env(files, name)
    with pytest.raises(RewardError) as info:
        env.score(_trajs(env, ["1", "2", "3"]))
    for needle in [*needles, f"env.rewards term {name!r}", "r.py:", "sample with prompt '0+0='"]:
        assert needle in str(info.value)


def test_two_terms_giving_one_component_name_are_refused(files) -> None:
    env = _env(files, "task,format")  # the arithmetic env's own reward has a format part too
    with pytest.raises(RewardError, match="reward component 'format' is given by two terms"):
        env.score(_trajs(env, ["0"]))
