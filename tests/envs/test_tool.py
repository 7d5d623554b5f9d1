"""Calculator tool environment: safe parser, multi-turn episodes, loss mask."""

from __future__ import annotations

import pytest

from hybrid_engine.envs.tool import CalcEnv
from hybrid_engine.tools.calculator import CalcError, calculate
from hybrid_engine.models.tokenizer import EOS_TOKEN_ID, build_tokenizer

TOK = build_tokenizer()


def _ids(text: str) -> list[int]:
    return TOK.encode(text).ids


@pytest.mark.parametrize(
    ("expr", "value"),
    [
        ("12*7", "84"),
        ("2+3*4", "14"),  # precedence
        ("(2+3)*4", "20"),  # parentheses
        ("10-4-3", "3"),  # left associativity
        ("100/10/5", "2"),
        ("7/2", "7/2"),  # exact division, reduced fraction
        ("6/4", "3/2"),
        ("-(3+4)*-2", "14"),  # unary signs
        (" ( 1 + 2 ) * ( 3 - 5 ) ", "-6"),
        ("((((8))))", "8"),
    ],
)
def test_calculate_hand_examples(expr, value):
    assert calculate(expr) == value


@pytest.mark.parametrize(
    ("expr", "needle"),
    [
        ("1/0", "division by zero"),
        ("5/(3-3)", "division by zero"),
        ("1.5+2", "unexpected character '.'"),
        ("2**3", "unexpected '*'"),
        ("__import__('os')", "unexpected character '_'"),
        ("x+1", "unexpected character 'x'"),
        ("(1+2", "unexpected end"),
        ("1+2)", "unexpected ')'"),
        ("1 2", "unexpected '2'"),
        ("", "empty expression"),
        ("1+" * 150 + "1", "longer than"),
        ("(" * 40 + "1" + ")" * 40, "nesting deeper"),
        ("\u0663+1", "unexpected character"),  # non-ASCII digit
    ],
)
def test_calculate_rejects_bad_input(expr, needle):
    with pytest.raises(CalcError) as info:
        calculate(expr)
    assert needle in str(info.value)


def test_multi_turn_episode_assembles_env_tokens_with_loss_mask_false():
    env = CalcEnv(TOK, max_turns=4)
    prompt = _ids("Compute 12*7+1. You may call <calc>EXPR</calc>. Answer with the integer.\n")
    state = env.reset(prompt)
    seg1 = _ids("Let me see <calc>12*7</calc>")
    env_ids, done = env.step(state, seg1)
    assert TOK.decode(env_ids) == "<result>84</result>" and not done
    seg2 = _ids(" so <calc>84+1</calc>")
    env_ids2, done = env.step(state, seg2)
    assert TOK.decode(env_ids2) == "<result>85</result>" and not done
    seg3 = _ids("85") + [EOS_TOKEN_ID]
    assert env.step(state, seg3) == ([], True)

    traj = env.build_trajectory(state, policy_logp=[-1.0] * (len(seg1) + len(seg2) + len(seg3)))
    assert traj.prompt_ids == prompt
    assert traj.response_ids == seg1 + env_ids + seg2 + env_ids2 + seg3
    expected_mask = [True] * len(seg1) + [False] * len(env_ids) + [True] * len(seg2)
    expected_mask += [False] * len(env_ids2) + [True] * len(seg3)
    assert traj.loss_mask == expected_mask
    assert [lp for lp, m in zip(traj.rollout_logp, traj.loss_mask) if not m] == [0.0] * (
        len(env_ids) + len(env_ids2)
    )
    assert all(lp == -1.0 for lp, m in zip(traj.rollout_logp, traj.loss_mask) if m)
    assert traj.info["num_tool_calls"] == 2 and traj.info["num_turns"] == 3
    env.score([traj])
    assert traj.reward == 1.0 and traj.reward_components == {"correct": 1.0}


def test_episode_ends_at_max_turns_and_tool_errors_do_not_crash():
    env = CalcEnv(TOK, max_turns=2)
    state = env.reset(_ids("Compute 1+1. x\n"))
    env_ids, done = env.step(state, _ids("<calc>1/0</calc>"))
    assert TOK.decode(env_ids) == "<result>error: CalcError: division by zero</result>"
    assert not done
    # The second turn is the last one (max_turns): nothing comes back.
    assert env.step(state, _ids("<calc>import os</calc>")) == ([], True)
    traj = env.build_trajectory(state)
    assert traj.info["num_tool_errors"] == 1 and traj.info["num_turns"] == 2
    env.score([traj])  # the episode ended on env tokens: no final answer
    assert traj.reward == 0.0


@pytest.mark.parametrize(
    ("final", "reward"),
    [("2", 1.0), (" 2\nbecause", 1.0), ("3", 0.0), ("two", 0.0), ("<calc>1+1", 0.0)],
)
def test_final_answer_reward(final, reward):
    env = CalcEnv(TOK)
    state = env.reset(_ids("Compute 1+1. x\n"))
    _, done = env.step(state, _ids(final) + [EOS_TOKEN_ID])
    assert done  # EOS ends the episode (an unclosed tag is no call)
    traj = env.build_trajectory(state)
    env.score([traj])
    assert traj.reward == reward


def test_segment_without_call_or_eos_is_final():
    env = CalcEnv(TOK)
    state = env.reset(_ids("Compute 1+1. x\n"))
    assert env.step(state, _ids("2")) == ([], True)
    with pytest.raises(ValueError, match="policy_logp has 3 entries"):
        env.build_trajectory(state, policy_logp=[0.0] * 3)


def test_generated_problems_are_seeded_and_solvable():
    a, b = CalcEnv(TOK, seed=4), CalcEnv(TOK, seed=4)
    prompts = a.sample_prompts(10)
    assert prompts == b.sample_prompts(10)
    held_out = {tuple(p) for p in a.eval_prompts(5)}
    assert not held_out & {tuple(p) for p in a.sample_prompts(500)}
    for ids in prompts:
        int(a.answer_for(TOK.decode(ids)))  # integer answers (no division generated)


@pytest.mark.parametrize("at_budget, reward", [("keep", 1.0), ("zero", 0.0)])
def test_the_episode_token_budget_cuts_and_scores_as_configured(at_budget, reward):
    """env.max_episode_tokens / env.at_budget reach the calculator environment: the
    second call's result would pass the budget, so the episode ends there."""
    from hybrid_engine.config import EnvConfig
    from hybrid_engine.envs import make_env

    call = _ids("1+1 is <calc>1+1</calc>")
    budget = 2 * len(call) + len(_ids("<result>2</result>")) + 2
    env = make_env(EnvConfig(name="tool", max_episode_tokens=budget, at_budget=at_budget), TOK)
    state = env.reset(_ids("Compute 1+1. x\n"))
    assert env.step(state, call)[1] is False
    assert env.step(state, _ids("2\n<calc>1+1</calc>")) == ([], True)
    traj = env.build_trajectory(state)
    assert traj.info["over_budget"] and len(traj.response_ids) <= budget
    env.score([traj])
    assert traj.reward == reward
