"""The tool demo's pieces, in-process: its task files, its tokenizer's words, its
warm-start traces (the RL environment's own token layout, the share of calls in
effect, the calculator's result copied) and its RL settings."""

from __future__ import annotations

import dataclasses
import re

import pytest

from hybrid_engine.demo.task import DemoTask

SMALL = dataclasses.replace(DemoTask(num_train=200, num_eval=20), min_digits=3, max_digits=4)


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> dict:
    from transformers import AutoTokenizer

    from hybrid_engine.demo.task import task_files
    from hybrid_engine.demo.tools import TOOL_MODEL_SPEC, template_file
    from hybrid_engine.models.tokenizer import write_tokenizer_files

    d = tmp_path_factory.mktemp("tool_demo")
    (d / "tok").mkdir()
    write_tokenizer_files(d / "tok", words=TOOL_MODEL_SPEC.words)
    train, test = task_files(d, SMALL)
    return {"tokenizer": AutoTokenizer.from_pretrained(d / "tok"), "train": str(train),
            "template": str(template_file(d)), "dir": d}


def _traces(demo: dict, share: float, num: int = 40, seed: int = 0, copy: float = 0.0) -> list:
    from hybrid_engine.demo.tools import ToolTraces

    return ToolTraces(demo["tokenizer"], dataset=demo["train"],
                      preprocess="hybrid_engine.envs.preprocess:gsm8k",
                      chat_template=demo["template"], tool_share=share, seed=seed,
                      copy_share=copy).next(num)


def test_operands_have_min_to_max_digits_and_bad_bounds_fail() -> None:
    train, _ = SMALL.rows()
    numbers = [int(n) for q in train["question"] for n in re.findall(r"\d+", q)]
    assert min(numbers) >= 100 and max(numbers) <= 9999 and max(numbers) >= 1000
    with pytest.raises(ValueError, match="min_digits"):
        DemoTask(min_digits=3, max_digits=2)


def test_a_trace_is_the_template_of_its_conversation_with_the_calculators_result(demo) -> None:
    from hybrid_engine.demo.tools import END_OF_TURN_ID
    from hybrid_engine.envs.chat import PromptFormat
    from hybrid_engine.tools.functions import load_tools

    tok = demo["tokenizer"]
    schemas = [t.schema for t in load_tools("calculator")]
    trace = next(t for t in _traces(demo, 1.0, num=4))
    question = tok.decode(trace.prompt_ids).split("user\n")[1].split("<|im_end|>")[0]
    a, b = (int(n) for n in re.findall(r"\d+", question))
    call = {"name": "calculator", "arguments": {"expression": f"{a}+{b}"}}
    messages = [{"role": "user", "content": question},
                {"role": "assistant", "content": "", "tool_calls": [{"function": call}]},
                {"role": "tool", "name": "calculator", "content": str(a + b)},
                {"role": "assistant", "content": str(a + b)}]
    text = PromptFormat(demo["template"]).render(tok, messages, tools=schemas)
    ids = trace.prompt_ids + trace.response_ids
    assert tok.decode(ids) + "\n" == text
    assert ids + tok.encode("\n", add_special_tokens=False) == tok.encode(
        text, add_special_tokens=False)
    assert trace.info["num_tool_calls"] == 1 and trace.info["num_tool_errors"] == 0
    assert trace.info["final_text"] == str(a + b) and trace.info["num_turns"] == 2
    # loss on the two sampled turns only: the call and the answer, each to its <|im_end|>
    sampled = [i for i, m in zip(trace.response_ids, trace.loss_mask) if m]
    assert tok.decode(sampled) == (f"<tool_call>\n{__import__('json').dumps(call)}\n</tool_call>"
                                   f"<|im_end|>{a + b}<|im_end|>")
    assert sampled.count(END_OF_TURN_ID) == 2


def test_the_tool_words_are_one_token_each_in_a_trace(demo) -> None:
    from hybrid_engine.demo.tools import TOOL_WORDS

    tok = demo["tokenizer"]
    trace = _traces(demo, 1.0, num=1)[0]
    pieces = {tok.decode([i]) for i in trace.prompt_ids + trace.response_ids}
    assert set(TOOL_WORDS) - {" {\""} <= pieces | {">\n"}, set(TOOL_WORDS) - pieces
    assert len(trace.prompt_ids) + len(trace.response_ids) < 110


@pytest.mark.parametrize("share", [0.0, 0.3, 1.0])
def test_tool_share_is_the_share_of_traces_that_call(demo, share: float) -> None:
    traces = _traces(demo, share, num=200)
    calls = sum(t.info["num_tool_calls"] for t in traces) / len(traces)
    assert abs(calls - share) < 0.08
    assert all(t.info["final_text"] == t.info["final_text"].strip() and
               t.info["final_text"].isdigit() for t in traces)
    assert [t.prompt_ids for t in traces] == [t.prompt_ids for t in _traces(demo, share, 200)]


def test_copy_traces_call_with_the_call_out_of_the_loss(demo) -> None:
    from hybrid_engine.demo.warmstart import WarmStartConfig

    tok = demo["tokenizer"]
    traces = _traces(demo, 0.3, num=40, copy=0.5)
    assert len(traces) == 60 and all(t.info["num_tool_calls"] == 1 for t in traces[40:])
    for t in traces[40:]:
        sampled = [i for i, m in zip(t.response_ids, t.loss_mask) if m]
        assert tok.decode(sampled) == t.info["final_text"] + "<|im_end|>"
    assert sum(t.info["num_tool_calls"] for t in traces[:40]) < 20
    with pytest.raises(ValueError, match="copy_share"):
        WarmStartConfig(copy_share=0.5)


def test_the_warm_start_key_follows_the_share_and_the_template_bytes(demo, tmp_path) -> None:
    from hybrid_engine.demo.tools import TOOL_MODEL_SPEC
    from hybrid_engine.demo.warmstart import WarmStartConfig, cache_key
    from hybrid_engine.models.tiny import write_tiny_model

    base = write_tiny_model(tmp_path / "base", dataclasses.replace(TOOL_MODEL_SPEC, num_layers=1))
    template = tmp_path / "t.jinja"
    template.write_text((demo["dir"] / "hermes_names.jinja").read_text())
    cfg = WarmStartConfig(dataset=demo["train"], chat_template=str(template), tool_share=0.3)
    key = cache_key(base, cfg)
    assert cache_key(base, dataclasses.replace(cfg, tool_share=0.5)) != key
    template.write_text(template.read_text() + " ")
    assert cache_key(base, cfg) != key
    with pytest.raises(ValueError, match="tool_share"):
        WarmStartConfig(tool_share=1.5)


def test_the_tool_demo_config_runs_the_calculator_in_two_hermes_turns() -> None:
    from hybrid_engine.demo import demo_config
    from hybrid_engine.demo.tools import END_OF_TURN_ID

    cfg = demo_config("m", "out", world=2, minutes=1.0, steps=5, data=("a", "b"), task="tools",
                      template="t.jinja", overrides=["env.max_turns=3"])
    assert (cfg.env.name, cfg.env.tools, cfg.env.tool_parser) == ("tools", "calculator", "hermes")
    assert cfg.env.chat_template == "t.jinja" and cfg.env.max_turns == 3
    assert list(cfg.rollout.stop_token_ids) == [END_OF_TURN_ID]
    plain = demo_config("m", "out", world=2, minutes=1.0, steps=5, data=("a", "b"))
    assert plain.env.name != "tools" and plain.env.chat_template == "auto"


def test_the_task_option_reaches_the_ranks_and_picks_the_model() -> None:
    import argparse

    from hybrid_engine.demo import add_arguments, demo_spec, relaunch_argv
    from hybrid_engine.demo.tools import TOOL_MODEL_SPEC

    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--task", "tools", "--set", "train.lr=1e-4"])
    assert "--task=tools" in relaunch_argv(args) and "--set=train.lr=1e-4" in relaunch_argv(args)
    assert demo_spec("tools") == TOOL_MODEL_SPEC and demo_spec() != TOOL_MODEL_SPEC
    with pytest.raises(SystemExit):
        p.parse_args(["--task", "chess"])
