"""The built-in `code` reward (envs/code_reward.py): the code it takes from a
completion, the test-case shapes it reads, the share of cases passed (each in
the sandbox, which tests/tools/test_sandbox.py checks), a completion that loops
forever or floods its output scoring 0 within its budget, the preflight's column
check, and env.rewards=code end to end in a reward worker."""

from __future__ import annotations

import json
import time

import pytest

from hybrid_engine.config import EnvConfig
from hybrid_engine.envs import make_env
from hybrid_engine.envs.code_reward import code_reward, extract_code, read_cases
from hybrid_engine.envs.rewards import check_columns, parse_rewards
from hybrid_engine.models.tokenizer import build_tokenizer
from hybrid_engine.tools.sandbox import Sandbox, SandboxLimits
from hybrid_engine.trajectory import Trajectory

FAST = Sandbox(SandboxLimits(timeout_s=1.0, output_kb=16))
ADD = "def add(a, b):\n    return a + b\n"
SUM_STDIN = "a, b = map(int, input().split())\nprint(a + b)\n"


@pytest.mark.parametrize("completion, code", [
    (f"Here:\n```python\n{ADD}```\nand better:\n```python\nx = 1\n```", "x = 1\n"),
    (f"```py\n{ADD}```", ADD),
    (f"```\n{ADD}```", ADD),
    (f"```Python3 \n{ADD}```", ADD),
    (ADD, ADD),
    ("```python\nunclosed", "```python\nunclosed"),
])
def test_the_code_is_the_last_python_block_else_the_whole_text(completion, code) -> None:
    assert extract_code(completion) == code


def test_the_test_case_shapes() -> None:
    asserts = ["assert add(1, 2) == 3", "assert add(0, 0) == 0"]
    pairs = [("1 2\n", "3\n"), ("3 4", "7")]
    assert read_cases(asserts) == asserts
    assert read_cases(json.dumps(asserts)) == asserts
    assert read_cases([{"input": i, "output": o} for i, o in pairs]) == pairs
    assert read_cases({"inputs": ["1 2\n", "3 4"], "outputs": ["3\n", "7"]}) == pairs
    assert read_cases(json.dumps({"inputs": [["1 2"]], "outputs": [["3"]]})) == [("1 2", "3")]
    for bad, message in [({"fn_name": "f", "inputs": [], "outputs": []}, "call-based"),
                         ([{"input": "1"}], "must be a list of assert"), (3, "must be a list"),
                         ([], "without test cases"), ("not json", "not JSON")]:
        with pytest.raises(ValueError, match=message):
            read_cases(bad)


def test_the_reward_is_the_share_of_cases_passed() -> None:
    completion = f"```python\n{ADD}```"
    cases = ["assert add(1, 2) == 3", "assert add(1, 1) == 3", "assert add(2, 2) == 4"]
    assert code_reward("p", completion, None, cases, sandbox=FAST) == pytest.approx(2 / 3)
    # exiting 0 before the assertion runs is not a pass
    assert code_reward("p", ADD + "import sys\nsys.exit(0)", None, cases[:1], sandbox=FAST) == 0
    pairs = [{"input": "1 2\n", "output": "3"}, {"input": "3 4\n", "output": "7  \n\n"},
             {"input": "5 5\n", "output": "11"}]
    assert code_reward("p", SUM_STDIN, None, pairs, sandbox=FAST) == pytest.approx(2 / 3)
    crash = SUM_STDIN + "raise SystemExit(1)\n"  # the right output, then a failure
    assert code_reward("p", crash, None, pairs[:1], sandbox=FAST) == 0


@pytest.mark.parametrize("completion", [
    "while True:\n    pass",
    "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)",
    "def add(a, b:\n    return a",
    "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
])
def test_code_that_never_passes_scores_zero_within_its_cases_timeouts(completion) -> None:
    start = time.monotonic()
    assert code_reward("p", completion, None, ["assert add(1, 2) == 3"] * 2, sandbox=FAST) == 0
    assert time.monotonic() - start < 2 * (FAST.limits.timeout_s + 1)


def test_the_budget_cuts_the_cases_short_before_the_workers_timeout() -> None:
    start = time.monotonic()
    assert code_reward("p", "while True:\n    pass", None, ["assert True"] * 5, sandbox=FAST,
                       budget_s=1.6) == 0
    assert time.monotonic() - start < 1.6 + 1.0  # 1 s, then 0.6 s, then none


def test_the_preflight_names_the_tests_column_and_the_timeouts_fit() -> None:
    [term] = parse_rewards("code")
    assert term.required == {"tests"} and term.columns == {"tests"}
    with pytest.raises(ValueError, match="term 'code' .* takes column 'tests', which rows.jsonl "
                                         "does not have"):
        check_columns([term], ["level"], "rows.jsonl")
    with pytest.raises(ValueError, match=r"env.reward_timeout_s=6 must be at least "
                                         r"env.sandbox_timeout_s \+ 2 = 7 with the code reward"):
        EnvConfig(rewards="code", reward_timeout_s=6.0)


def test_env_rewards_code_scores_completions_in_a_reward_worker(tmp_path) -> None:
    """make_env with env.rewards=code and env.sandbox_*: the worker gets the run's
    sandbox and a budget under env.reward_timeout_s."""
    tok = build_tokenizer()
    rows = [{"prompt": f"Write add, {i}", "answer": "", "tests": ["assert add(1, 2) == 3",
                                                                  "assert add(2, 2) == 4"]}
            for i in range(4)]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    env = make_env(EnvConfig(dataset_path=str(data), eval_dataset_path=str(data),
                             chat_template="none", rewards="code", reward_workers=1,
                             reward_timeout_s=4.0, sandbox_timeout_s=1.0), tok)
    try:
        [term] = env.terms
        assert term.settings == {"sandbox": Sandbox(SandboxLimits(timeout_s=1.0)),
                                 "budget_s": 2.5}
        completions = [f"```python\n{ADD}```", "def add(a, b):\n    return a * 2",
                       "while True:\n    pass", "def add(a, b:"]
        trajs = []
        for prompt, text in zip(env.eval_prompts(4), completions, strict=True):
            ids = tok.encode(text).ids + [env.eos_id]
            trajs.append(Trajectory(prompt_ids=prompt, response_ids=ids,
                                    rollout_logp=[0.0] * len(ids), loss_mask=[True] * len(ids)))
        env.score(trajs)
        assert [t.reward_components["code"] for t in trajs] == [1.0, 0.5, 0.0, 0.0]
    finally:
        env.close()
