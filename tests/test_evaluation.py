"""Held-out evaluation: the pass@k and maj@k estimators against hand computations
and brute force, the metrics per data source, and the Evaluator's prompts,
sampling settings and seeds (a recording policy; the 2-rank runs with the real
engine are in tests/test_faults.py)."""

from __future__ import annotations

import itertools
import json
import math
from fractions import Fraction

import pytest

from hybrid_engine.config import RunConfig, apply_overrides
from hybrid_engine.evaluation import (Evaluator, answer_key, majority_correct, pass_at_k,
                                      sampled_metrics)
from hybrid_engine.trajectory import Trajectory


@pytest.mark.parametrize(("n", "c", "k", "want"), [
    (4, 0, 1, 0.0), (4, 4, 4, 1.0), (4, 1, 1, 0.25), (4, 1, 2, 0.5), (4, 2, 2, 5 / 6),
    (5, 2, 3, 0.9), (10, 3, 1, 0.3), (8, 1, 8, 1.0), (16, 0, 16, 0.0)])
def test_pass_at_k_equals_hand_computations(n, c, k, want) -> None:
    # e.g. n=4, c=2, k=2: 1 - C(2,2)/C(4,2) = 1 - 1/6; n=5, c=2, k=3: 1 - C(3,3)/C(5,3) = 0.9
    assert pass_at_k(n, c, k) == pytest.approx(want, abs=1e-12)


def test_pass_at_k_equals_the_share_of_k_subsets_holding_a_correct_sample() -> None:
    for n in range(1, 8):
        for c in range(n + 1):
            samples = [True] * c + [False] * (n - c)
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(samples, k))
                want = Fraction(sum(any(s) for s in subsets), len(subsets))
                assert pass_at_k(n, c, k) == pytest.approx(float(want), abs=1e-12), (n, c, k)


@pytest.mark.parametrize(("n", "c", "k"), [(4, 1, 0), (4, 1, 5), (4, 5, 2), (4, -1, 2)])
def test_pass_at_k_refuses_impossible_counts(n, c, k) -> None:
    with pytest.raises(ValueError, match="pass@k needs"):
        pass_at_k(n, c, k)


@pytest.mark.parametrize(("answers", "correct", "want"), [
    (["3", "4", "3"], [True, False, True], True),           # 3 wins 2:1
    (["4", "3", "3"], [False, True, True], True),
    (["4", "3", "4", "3"], [False, True, False, True], False),  # 2:2 tie: 4 came first
    (["3", "4", "4", "3"], [True, False, False, True], True),   # 2:2 tie: 3 came first
    ([None, None, "4", "3"], [False, False, False, True], False),  # Nones never vote
    ([None, None], [False, False], False),                   # no answer at all: wrong
    (["5"], [True], True)])
def test_majority_ties_go_to_the_answer_reached_first(answers, correct, want) -> None:
    assert majority_correct(answers, correct) is want


def test_answers_compare_by_their_parsed_value() -> None:
    assert answer_key("12 books") == answer_key("The answer is \\boxed{12}") == answer_key("12")
    assert answer_key("12") != answer_key("13")
    assert answer_key("no number here") is None


def _traj(group: int, correct: bool, reward: float | None = None) -> Trajectory:
    t = Trajectory(prompt_ids=[1], response_ids=[2, 3], rollout_logp=[0.0, 0.0], group_id=group)
    t.reward = float(correct) if reward is None else reward
    t.reward_components = {"correct": float(correct)}
    return t


def test_sampled_metrics_per_prompt_and_per_source() -> None:
    """Two prompts x 4 samples: prompt 0 (source a) has 2 correct, prompt 1
    (source b) 3; maj@4: prompt 0's answers tie 2:2 and the first (right) wins;
    prompt 1's majority is right."""
    oks = [[True, False, False, True], [True, True, False, True]]
    answers = ["7", "8", "8", "7", "5", "5", "6", "5"]  # prompt 0: "7" (right) ties "8"
    trajs = [_traj(p, ok) for p in range(2) for ok in oks[p]]
    m = sampled_metrics(trajs, ["a", "b"], 4, (1, 4), answers)
    want_pass1 = (2 / 4 + 3 / 4) / 2
    assert m["eval/mean@4"] == pytest.approx(want_pass1)
    assert m["eval/pass@1"] == pytest.approx(want_pass1)  # pass@1 is mean@n
    assert m["eval/pass@4"] == 1.0
    assert m["eval/maj@4"] == 1.0  # prompt 0: "7" (first of the 2:2 tie) is right
    assert m["eval/maj@1"] == pytest.approx((1 + 1) / 2)  # each prompt's first sample
    assert m["eval/a/mean@4"] == 0.5 and m["eval/b/mean@4"] == 0.75
    assert m["eval/b/pass@1"] == 0.75 and "eval/c/pass@1" not in m


def test_chat_episodes_add_tool_metrics_to_greedy_and_sampled_evaluations() -> None:
    """A chat environment's episodes (num_tool_calls in info): the tool metrics of
    greedy and sampled evaluations, per source too; plain completions have none."""
    from hybrid_engine.evaluation import greedy_metrics

    trajs = [_traj(p, ok) for p in range(2) for ok in (True, False)]
    for i, t in enumerate(trajs):
        t.info.update(num_tool_calls=i, num_tool_errors=i % 2, num_turns=1 + i,
                      observation_tokens=10 * i)
    g = greedy_metrics(trajs, [None, None])
    assert (g["eval/tool/calls"], g["eval/tool/errors"], g["eval/turns_mean"],
            g["eval/observation_tokens_mean"]) == (1.5, 0.5, 2.5, 15.0)
    m = sampled_metrics(trajs, ["a", "b"], 2, (1,), ["1"] * 4)
    assert m["eval/a/sampled_tool/calls"] == 0.5 and m["eval/b/sampled_tool/calls"] == 2.5
    assert m["eval/b/sampled_turns_mean"] == 3.5
    plain = [_traj(0, True), _traj(0, False)]
    assert not any("tool" in k for k in {**greedy_metrics(plain, [None, None]),
                                        **sampled_metrics(plain, [None, None], 2, (1,),
                                                          ["1", "2"])})


class _RecordingPolicy:
    """Answers prompt p with completion token p (correct when p is even)."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def switch_to(self, layout: str) -> None:
        pass

    def collect(self, env, prompts, *, num_samples, seed, sampling=None):  # noqa: ANN001, ANN201
        self.calls.append({"prompts": [list(p) for p in prompts], "n": num_samples,
                           "seed": seed, "sampling": dict(sampling or {})})
        return [Trajectory(prompt_ids=list(p), response_ids=[5 + j], rollout_logp=[0.0],
                           group_id=i) for i, p in enumerate(prompts) for j in range(num_samples)]


def _evaluate(tmp_path, overrides: dict, steps=(3,), write_samples=None):  # noqa: ANN202
    """An Evaluator over a 5-row eval file (rows 1 and 3 from source "b"), scored
    as correct when the sample index is even; (policy calls, metrics per step)."""
    from hybrid_engine.envs import make_env
    from hybrid_engine.models.tokenizer import build_tokenizer

    rows = [{"prompt": f"{i}+{i}=", "answer": str(2 * i), "data_source": "ab"[i % 2]}
            for i in range(5)]
    path = tmp_path / "eval.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    cfg = apply_overrides(RunConfig(), {"env.dataset_path": str(path),
                                        "env.eval_dataset_path": str(path),
                                        "env.chat_template": "none", **overrides})
    env, policy = make_env(cfg.env, build_tokenizer()), _RecordingPolicy()

    def score(trajs: list) -> None:
        for t in trajs:
            t.reward_components = {"correct": float(t.response_ids[0] % 2 == 1)}
            t.reward = t.reward_components["correct"]

    ev = Evaluator(policy, env, cfg, score, write_samples=write_samples)
    return policy.calls, [ev(s) for s in steps], env


def test_the_samples_file_holds_each_sample_once_and_gives_back_pass_at_k(tmp_path) -> None:
    """The rows an evaluation writes (`eval_samples`): each prompt x sample of each
    pass once, with its prompt, completion, answer, rewards and correctness, and
    the sampled pass's pass@k and mean@n recomputed from the lines alone (the
    unbiased estimator, written out here) equal the reported ones."""
    from hybrid_engine.metrics import SampleFile

    out = SampleFile(tmp_path / "samples.jsonl")
    _, (m,), _ = _evaluate(tmp_path, {"eval.num_prompts": 0, "eval.num_samples": 4,
                                      "eval.pass_k": (1, 2, 3)}, write_samples=out.write)
    rows = [json.loads(ln) for ln in (tmp_path / "samples.jsonl").read_text().splitlines()]
    keys = [(r["pass"], r["prompt_index"], r["sample"]) for r in rows]
    assert sorted(keys) == sorted([("greedy", p, 0) for p in range(5)]
                                  + [("sampled", p, k) for p in range(5) for k in range(4)])
    assert {r["step"] for r in rows} == {3}
    first = rows[0]
    assert first["prompt"] == "0+0=" and first["answer"] == "0" and first["data_source"] == "a"
    assert first["rewards"] == {"correct": 1.0} and first["correct"] is True
    assert first["completion"] == _tokenizer().decode([5], skip_special_tokens=True)
    sampled = [r for r in rows if r["pass"] == "sampled"]
    assert all("extracted" in r for r in sampled)
    counts = {}
    for r in sampled:
        counts.setdefault(r["prompt_index"], []).append(r["correct"])
    for k in (1, 2, 3):
        want = sum(1 - math.comb(len(c) - sum(c), k) / math.comb(len(c), k)
                   for c in counts.values()) / len(counts)
        assert m[f"eval/pass@{k}"] == pytest.approx(want, abs=1e-12), k
    assert m["eval/mean@4"] == pytest.approx(sum(r["correct"] for r in sampled) / len(sampled))
    accuracy = [r["correct"] for r in rows if r["pass"] == "greedy"]
    assert m["eval/accuracy"] == sum(accuracy) / len(accuracy)
    # A resumed run's file keeps the rows of the steps before the resume, and only them.
    SampleFile(tmp_path / "samples.jsonl", resume=4).write([{"step": 4}])
    kept = (tmp_path / "samples.jsonl").read_text().splitlines()
    assert len(kept) == len(rows) + 1
    SampleFile(tmp_path / "samples.jsonl", resume=3)
    assert (tmp_path / "samples.jsonl").read_text() == ""


def _eval_cli(argv: list[str]) -> int:
    """`hybrid-engine eval ARGV` up to where it would start an engine, in this
    process (through the command's parser, not `cli.main`, which sets the
    libraries' log levels in os.environ for every later subprocess)."""
    from hybrid_engine import cli

    args, rest = cli._parser().parse_known_args(["eval", *argv])
    return cli._cmd_eval(args, rest)


def _tokenizer():  # noqa: ANN202
    from hybrid_engine.models.tokenizer import build_tokenizer

    return build_tokenizer()


def test_eval_takes_an_eval_file_alone_and_evaluates_all_of_it(tmp_path, capsys) -> None:
    """`hybrid-engine eval` with an evaluation file and no training file: its whole
    file unless --eval.num_prompts (or --config) says otherwise; a generated task
    keeps the default; --output into a folder that does not exist is one error
    line before any engine."""
    from hybrid_engine import cli

    path = tmp_path / "eval.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n"
                            for i in range(3)))

    def config(*flags: str) -> RunConfig:
        args, rest = cli._parser().parse_known_args(["eval", "--model.path=m", *flags])
        return cli.eval_config(args, rest)

    cfg = config(f"--env.eval_dataset_path={path}")
    assert cfg.eval.num_prompts == 0 and not cfg.env.dataset_path
    # One process: the recipe's TP 2 does not divide it, so one engine (unless told).
    assert cfg.rollout.tensor_parallel_size == 1
    assert config("--rollout.tensor_parallel_size=2").rollout.tensor_parallel_size == 2
    assert config(f"--env.eval_dataset_path={path}", "--eval.num_prompts=2").eval.num_prompts == 2
    (tmp_path / "c.yaml").write_text("eval:\n  num_prompts: 1\n")
    assert config(f"--env.eval_dataset_path={path}", f"--config={tmp_path / 'c.yaml'}"
                  ).eval.num_prompts == 1
    assert config().eval.num_prompts == RunConfig().eval.num_prompts  # generated problems
    from hybrid_engine.envs import make_env

    env = make_env(cfg.env, _tokenizer())
    assert len(env.eval_prompts(0)) == 3
    assert _eval_cli(["--model.path=m", f"--env.eval_dataset_path={path}",
                      f"--output={tmp_path / 'none' / 'out.jsonl'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --output=") and "does not exist" in err[0]


def test_the_evaluator_uses_every_eval_knob(tmp_path) -> None:
    calls, (m,), env = _evaluate(tmp_path, {
        "eval.num_prompts": 0, "eval.num_samples": 4, "eval.pass_k": (1, 2),
        "eval.temperature": 0.7, "eval.top_p": 0.9, "eval.max_tokens": 5})
    greedy, sampled = calls
    want = [list(p) for p in env.eval_prompts(5)]
    assert greedy["prompts"] == sampled["prompts"] == want  # num_prompts=0: the whole file
    assert greedy["n"] == 1 and greedy["sampling"] == {"top_k": 1, "max_tokens": 5}
    assert sampled["n"] == 4
    assert sampled["sampling"] == {"temperature": 0.7, "top_p": 0.9, "max_tokens": 5}
    assert m["eval/prompts"] == 5.0
    # greedy: sample 0 of each prompt (token 5, correct); sampled: tokens 5..8, 2 correct
    assert m["eval/accuracy"] == 1.0 and m["eval/mean@4"] == 0.5
    assert m["eval/pass@1"] == 0.5 and m["eval/pass@2"] == pytest.approx(5 / 6)
    assert "eval/pass@4" not in m and "eval/maj@2" in m
    assert m["eval/a/mean@4"] == m["eval/b/mean@4"] == 0.5  # rows carry a data_source


def test_the_evaluator_greedy_off_num_prompts_and_seeds(tmp_path) -> None:
    calls, metrics, _ = _evaluate(tmp_path, {"eval.num_prompts": 2, "eval.greedy": False,
                                             "eval.num_samples": 2}, steps=(3, 4, 3))
    assert [c["n"] for c in calls] == [2, 2, 2]  # no greedy pass
    assert all(len(c["prompts"]) == 2 for c in calls)
    assert "eval/accuracy" not in metrics[0] and "eval/pass@2" in metrics[0]
    seeds = [c["seed"] for c in calls]
    assert seeds[0] == seeds[2] != seeds[1]  # a step's evaluation repeats exactly


@pytest.mark.parametrize(("overrides", "error"), [
    ({"eval.num_samples": 4, "eval.pass_k": (0,)}, "each k must be 1..eval.num_samples=4"),
    ({"eval.num_samples": 4, "eval.pass_k": (8,)}, "k=8: each k must be 1..eval.num_samples=4"),
    ({"eval.pass_k": (1,)}, "eval.num_samples=0"),
    ({"eval.greedy": False}, "leaves nothing to evaluate"),
    ({"eval.max_tokens": 4096}, "eval.max_tokens=4096 must be < rollout.max_model_len"),
])
def test_impossible_eval_settings_are_refused(overrides, error) -> None:
    with pytest.raises(ValueError, match=error.replace("(", r"\(").replace(".", r"\.")):
        apply_overrides(RunConfig(), overrides)


def test_all_prompts_needs_a_dataset() -> None:
    from hybrid_engine.config import EnvConfig
    from hybrid_engine.envs import make_env
    from hybrid_engine.models.tokenizer import build_tokenizer

    env = make_env(EnvConfig(chat_template="none"), build_tokenizer())
    with pytest.raises(ValueError, match="eval.num_prompts=0 \\(all\\) needs a dataset"):
        env.eval_prompts(0)


def test_eval_refuses_a_folder_that_is_no_checkpoint_before_any_engine(model_dir, tmp_path) -> None:
    from hybrid_engine.config.recipes import get_recipe
    from hybrid_engine.job import evaluate_model

    cfg = apply_overrides(get_recipe("tiny_grpo_debug"), {"model.path": model_dir,
                                                          "rollout.tensor_parallel_size": 1})
    (tmp_path / "step_00000004").mkdir()  # no COMPLETE marker: a save that never finished
    with pytest.raises(ValueError, match="is not a complete checkpoint folder"):
        evaluate_model(cfg, checkpoint=str(tmp_path / "step_00000004"))


def test_the_plot_draws_every_evaluation_curve_under_the_run_name(tmp_path) -> None:
    from hybrid_engine.metrics import plot_curves, plot_metrics

    rows = [{"step": 0, "eval/accuracy": 0.2, "eval/mean@4": 0.1, "eval/pass@4": 0.3,
             "eval/pass@1": 0.1, "eval/maj@4": 0.2, "eval/a/pass@4": 0.9},
            {"step": 1, "reward_mean": 0.5},
            {"step": 2, "reward_mean": 0.6, "eval/accuracy": 0.4, "eval/mean@4": 0.2,
             "eval/pass@4": 0.5, "eval/pass@1": 0.2, "eval/maj@4": 0.3}]
    curves = {label: pts for label, _, pts in plot_curves(rows)}
    assert list(curves) == ["train reward", "held-out accuracy (greedy)", "held-out maj@4",
                            "held-out mean@4", "held-out pass@1", "held-out pass@4"]
    assert curves["held-out pass@4"] == [(0, 0.3), (2, 0.5)]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    plot_metrics(path, tmp_path / "metrics.png", title="my-run")
    assert (tmp_path / "metrics.png").stat().st_size > 1000


def test_compare_lists_the_prompts_that_flipped_between_two_samples_files(tmp_path,
                                                                          capsys) -> None:
    """`hybrid-engine eval --compare A B`: prompt by prompt (a run's file: its last
    step; greedy where there is one, else at least half the samples right), no
    engine; a file that is not one is one error line."""

    def row(step: int, prompt: str, correct: bool, kind: str = "greedy") -> dict:
        return {"step": step, "pass": kind, "prompt": prompt, "correct": correct}

    a = [row(0, "p1", True), row(0, "p2", True), row(0, "p3", False), row(0, "p4", False),
         row(5, "p1", False), row(5, "p2", True), row(5, "p3", False), row(5, "p4", False),
         row(5, "p5", True)]  # the run's last step, 5, is A
    b = [row(0, p, c, "sampled") for p, cs in (("p1", (1, 1)), ("p2", (0, 0)), ("p3", (1, 0)),
                                               ("p4", (0, 0))) for c in map(bool, cs)]
    for name, rows in (("a", a), ("b", b)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert _eval_cli(["--compare", str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert got == {"prompts": 4, "only_a": 1, "only_b": 0, "a_right": 1, "b_right": 2,
                   "fixed": ["p1", "p3"], "broken": ["p2"]}
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    assert _eval_cli(["--compare", str(tmp_path / "a.jsonl"), str(tmp_path / "bad.jsonl")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: --compare: {str(tmp_path / 'bad.jsonl')!r}, line 1: not JSON"]
