"""Chat environments token-in/token-out (envs/agent.py): a Qwen2.5-shaped hermes
template, real tools, the rollout loop's own checks. The model's turns are
scripted (the rollout loop and vLLM: tests/rollout/test_episodes.py and the
2-rank runs); what is tested is that its tokens are kept as sampled and the
observations are exactly what the template adds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from hybrid_engine.envs.agent import ChatEnv, ToolTask
from hybrid_engine.envs.chat import PromptFormat
from hybrid_engine.envs.dataset import DatasetSpec
from hybrid_engine.envs.reward_pool import RewardPool
from hybrid_engine.metrics import trajectory_metrics
from hybrid_engine.models.templates import HERMES_TOOLS_TEMPLATE
from hybrid_engine.models.tokenizer import write_tokenizer_files
from hybrid_engine.tools.functions import load_tools

TOOLS = f"{Path(__file__).parents[1] / 'tools' / 'sample_tools.py'}:add,search"


def _tokenizer(folder: Path, words: tuple[str, ...] = ()) -> AutoTokenizer:
    folder.mkdir(parents=True, exist_ok=True)
    write_tokenizer_files(folder, words=words)
    tok = AutoTokenizer.from_pretrained(folder)
    tok.chat_template = HERMES_TOOLS_TEMPLATE
    return tok


def _env(tmp_path: Path, tok, **kw) -> ChatEnv:  # noqa: ANN001
    rows = [{"prompt": f"What is {i} plus 3, then searched?", "answer": str(i + 3)}
            for i in range(40)]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tools = load_tools(TOOLS)
    from hybrid_engine.tools.parsers import tool_parser

    task = ToolTask(tools, RewardPool(0, 0), prompt_format=PromptFormat())
    return ChatEnv(tok, task, dataset=DatasetSpec(str(data)), parser=tool_parser("hermes"),
                   tools=tools, **kw)


def _assistant_text(tok, messages: list, turn: dict, schemas: list) -> str:  # noqa: ANN001
    """What a model that samples the canonical text writes for turn, up to and
    including its end-of-turn token (not the template's newline after it)."""
    before = tok.apply_chat_template(messages, tools=schemas, tokenize=False,
                                     add_generation_prompt=True)
    after = tok.apply_chat_template([*messages, turn], tools=schemas, tokenize=False)
    assert after.startswith(before)
    return after[len(before):].removesuffix("\n")


TURNS = [  # the model's three turns: one call, two calls at once, the answer
    {"role": "assistant", "content": "Let me add.",
     "tool_calls": [{"type": "function", "function": {"name": "add",
                                                       "arguments": {"a": 4, "b": 3}}}]},
    {"role": "assistant", "content": "",
     "tool_calls": [{"type": "function", "function": {"name": "search",
                                                       "arguments": {"query": "7"}}},
                    {"type": "function", "function": {"name": "add",
                                                       "arguments": {"a": 7, "b": 0}}}]},
    {"role": "assistant", "content": "The answer is 7."},
]
RESULTS = [[{"role": "tool", "name": "add", "content": "7"}],
           [{"role": "tool", "name": "search", "content": "3 notes match '7'"},
            {"role": "tool", "name": "add", "content": "7"}], []]


def test_an_episode_is_the_templated_conversation_token_for_token(tmp_path) -> None:
    """3 turns, 3 calls (2 in one turn): prompt_ids + response_ids are the template's
    ids of the whole conversation (less the newline after the last turn, which the
    model does not sample); loss_mask is True exactly on the sampled turns."""
    tok = _tokenizer(tmp_path / "tok")
    env = _env(tmp_path, tok)
    [prompt] = env.sample_prompts(1)
    state = env.reset(prompt)
    messages, schemas, mask = list(state.messages), env.schemas, []
    for turn, results in zip(TURNS, RESULTS, strict=True):
        segment = tok.encode(_assistant_text(tok, messages, turn, schemas),
                             add_special_tokens=False)
        obs, done = env.step(state, segment)
        mask += [True] * len(segment) + [False] * len(obs)
        messages += [turn, *results]
        assert done == (not results)
    traj = env.build_trajectory(state, None, 0)
    whole = tok.apply_chat_template(messages, tools=schemas, tokenize=True)["input_ids"]
    assert traj.prompt_ids + traj.response_ids == whole[:-1]
    assert tok.decode(whole[-1:]) == "\n"
    assert traj.loss_mask == mask
    assert traj.info["num_turns"] == 3 and traj.info["num_tool_calls"] == 3
    assert traj.info["final_text"] == "The answer is 7."
    m = trajectory_metrics([traj])
    assert (m["tool/calls"], m["tool/errors"], m["turns_mean"]) == (3.0, 0.0, 3.0)
    assert m["observation_tokens_mean"] == len(traj.response_ids) - sum(traj.loss_mask)


def test_a_sampled_tokenization_is_kept_as_sampled(tmp_path) -> None:
    """The model may sample a text in pieces its tokenizer would not choose (here
    ' answer' as bytes, where the vocabulary has it as one token): the episode keeps
    those ids; re-encoding the text would give the one token."""
    tok = _tokenizer(tmp_path / "tok", words=(" answer",))
    env = _env(tmp_path, tok)
    [prompt] = env.sample_prompts(1)
    state = env.reset(prompt)
    text = _assistant_text(tok, list(state.messages), TURNS[2], env.schemas)
    canonical = tok.encode(text, add_special_tokens=False)
    pieces = [b for b in " answer".encode()]  # byte ids: id == byte value
    start = text.index(" answer")
    odd = (tok.encode(text[:start], add_special_tokens=False) + pieces
           + tok.encode(text[start + len(" answer"):], add_special_tokens=False))
    assert odd != canonical and tok.decode(odd) == tok.decode(canonical)
    env.step(state, odd)
    traj = env.build_trajectory(state, None, 0)
    assert traj.response_ids == odd


@pytest.mark.parametrize(("knob", "value"), [("max_turns", 1), ("max_episode_tokens", 60)])
def test_turn_and_token_budgets_end_an_episode(tmp_path, knob, value) -> None:
    """max_turns=1 ends after the first turn's call (no observation); a token budget
    smaller than the first observation ends it there, cut (over_budget), and
    at_budget=zero scores it 0."""
    tok = _tokenizer(tmp_path / "tok")
    env = _env(tmp_path, tok, **{knob: value}, at_budget="zero")
    [prompt] = env.sample_prompts(1)
    state = env.reset(prompt)
    segment = tok.encode(_assistant_text(tok, list(state.messages), TURNS[0], env.schemas),
                         add_special_tokens=False)
    obs, done = env.step(state, segment)
    assert done and obs == []
    traj = env.build_trajectory(state, None, 0)
    assert traj.info["over_budget"] == (knob == "max_episode_tokens")
    assert env._reward(traj, "") == {"episode": 0.0}


def test_bad_calls_come_back_as_tool_errors_in_call_order(tmp_path) -> None:
    """An unknown tool, wrong argument types and malformed JSON are tool messages
    saying what is wrong; the valid call between them runs; the penalty counts them."""
    tok = _tokenizer(tmp_path / "tok")
    env = _env(tmp_path, tok)
    env.task.error_penalty = 0.5
    [prompt] = env.sample_prompts(1)
    state = env.reset(prompt)
    text = ('<tool_call>\n{"name": "mul", "arguments": {"a": 1}}\n</tool_call>\n'
            '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
            '<tool_call>\n{"name": "add", "arguments": {"a": "x", "b": 2}}\n</tool_call>\n'
            '<tool_call>\n{"name": "add", "arguments": {"a": 1,\n</tool_call><|im_end|>')
    obs, done = env.step(state, tok.encode(text, add_special_tokens=False))
    assert not done
    replies = [m for m in state.messages if m["role"] == "tool"]
    assert len(replies) == 4 and replies[1]["content"] == "3"
    assert replies[0]["content"].startswith("error: unknown tool 'mul'")
    assert replies[2]["content"].startswith("error: ") and "'a'" in replies[2]["content"] \
        or "a:" in replies[2]["content"]
    assert replies[3]["content"].startswith("error: tool call 4: ")
    traj = env.build_trajectory(state, None, 0)
    assert traj.info["num_tool_calls"] == 4 and traj.info["num_tool_errors"] == 3
    assert traj.info["episode_parts"] == {"tool_errors": -1.5}


def test_the_rollout_loop_runs_tool_episodes_and_checks_their_context(tmp_path) -> None:
    """Through `episodes.collect` (its context and loss-mask checks): sample 0 calls
    add and then answers from its result, sample 1 answers at once."""
    from hybrid_engine.rollout.episodes import collect
    from tests.rollout.test_episodes import ScriptedRollout

    tok = _tokenizer(tmp_path / "tok")
    env = _env(tmp_path, tok)
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 4, "b": 3}}\n</tool_call><|im_end|>'

    def policy(context: str, sample: int) -> str:
        if sample == 0 and "<tool_response>" not in context:
            return call
        return "7<|im_end|>" if "<tool_response>\n7\n" in context else "8<|im_end|>"

    rollout = ScriptedRollout(policy)
    rollout.cfg = type(rollout.cfg)(max_model_len=2048, max_tokens=128)
    trajs = collect(rollout, env, env.sample_prompts(1), num_samples=2, seed=0)
    assert [(t.info["num_tool_calls"], t.info["num_tool_errors"]) for t in trajs] == [(1, 0),
                                                                                      (0, 0)]
    assert [t.info["final_text"] for t in trajs] == ["7", "8"]
    assert [t.info["num_turns"] for t in trajs] == [2, 1]
    assert len(rollout.calls) == 2 and len(rollout.calls[1]["prompts"]) == 1  # one went on


def test_the_env_section_reaches_the_tools_environment(tmp_path) -> None:
    """Each env.* knob of env.name=tools lands where it acts (make_env from config)."""
    from hybrid_engine.config import EnvConfig
    from hybrid_engine.envs import make_env
    from hybrid_engine.tools.sandbox import Sandbox, SandboxLimits

    tok = _tokenizer(tmp_path / "tok")
    rows = [{"prompt": f"{i}+3=", "answer": str(i + 3)} for i in range(40)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    env = make_env(EnvConfig(
        name="tools", tools=f"{TOOLS},python", tool_parser="mistral", tool_workers=3,
        tool_timeout_s=7.0, tool_error_penalty=0.5, max_turns=2, max_episode_tokens=77,
        at_budget="zero", sandbox_url="http://sandbox:8080/run_code", sandbox_timeout_s=3.0,
        sandbox_memory_mb=256, sandbox_output_kb=8, sandbox_processes=5,
        dataset_path=str(tmp_path / "d.jsonl")), tok)
    try:
        assert env.parser.name == "mistral" and [s["function"]["name"] for s in env.schemas] == \
            ["add", "search", "python"]
        assert (env.max_turns, env.max_episode_tokens, env.at_budget) == (2, 77, "zero")
        assert (env.task.pool.workers, env.task.pool.timeout_s) == (3, 7.0)
        assert env.task.error_penalty == 0.5
        assert env.task.tools["python"].settings == {"sandbox": Sandbox(
            SandboxLimits(timeout_s=3.0, memory_mb=256, output_kb=8, processes=5),
            url="http://sandbox:8080/run_code")}
    finally:
        env.close()
