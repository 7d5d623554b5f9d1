"""Chat templates: env.chat_template (auto, none, a .jinja file), env.system_prompt and
env.chat_template_kwargs each change the prompt ids, which equal transformers'
`apply_chat_template(..., add_generation_prompt=True)` exactly, for training and
evaluation prompts of every environment. In-process, on the tiny models' tokenizer
(byte-level, a ChatML template). Refusals through the CLI's own path:
tests/test_preflight.py."""

from __future__ import annotations

import json

import pytest

from hybrid_engine.config import EnvConfig
from hybrid_engine.envs import PromptFormat, make_env
from hybrid_engine.envs.base import decode

# A template of our own: [role] content lines, and a thinking switch like Qwen3's.
TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant] {% if enable_thinking is defined and "
            "not enable_thinking %}<think></think>{% endif %}{% endif %}")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from hybrid_engine.models.tokenizer import write_tokenizer_files

    folder = tmp_path_factory.mktemp("tok")
    write_tokenizer_files(folder)
    return AutoTokenizer.from_pretrained(folder)


@pytest.fixture
def data(tmp_path):
    rows = [{"question": f"What is {i}+{i}?", "answer": str(2 * i)} for i in range(6)]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path), [r["question"] for r in rows]


def _env(data, tokenizer, **kw):  # noqa: ANN001, ANN003, ANN202
    path, _ = data
    return make_env(EnvConfig(dataset_path=path, eval_dataset_path=path, prompt_key="question",
                              **kw), tokenizer)


def _templated(tokenizer, messages, **kw):  # noqa: ANN001, ANN003, ANN202
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                         return_dict=False, **kw)


def test_auto_templates_text_prompts_as_one_user_message_and_none_keeps_raw_text(data, tokenizer):
    _, questions = data
    auto = _env(data, tokenizer).eval_prompts(6)  # auto is the default
    assert auto == [_templated(tokenizer, [{"role": "user", "content": q}]) for q in questions]
    raw = _env(data, tokenizer, chat_template="none").eval_prompts(6)
    assert raw == [tokenizer.encode(q, add_special_tokens=False) for q in questions]
    env = _env(data, tokenizer)
    trained = env.sample_prompts(6)  # training prompts go through the same template
    assert sorted(trained) == sorted(auto)
    text = decode(tokenizer, trained[0])  # its answer is found by the templated text
    question = next(q for q in questions if q in text)
    assert env.answer_for(text) == str(2 * int(question.split("+")[1][:-1]))


def test_a_jinja_file_replaces_the_tokenizers_template(data, tokenizer, tmp_path):
    _, questions = data
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    got = _env(data, tokenizer, chat_template=str(path)).eval_prompts(6)
    assert got == [_templated(tokenizer, [{"role": "user", "content": q}], chat_template=TEMPLATE)
                   for q in questions]
    assert decode(tokenizer, got[0]) == f"[user] {questions[0]}\n[assistant] "


def test_the_system_prompt_goes_first_unless_the_prompt_has_its_own(data, tokenizer):
    _, questions = data
    got = _env(data, tokenizer, system_prompt="Be brief.").eval_prompts(6)
    assert got == [_templated(tokenizer, [{"role": "system", "content": "Be brief."},
                                          {"role": "user", "content": q}]) for q in questions]
    own = [{"role": "system", "content": "Mine."}, {"role": "user", "content": "hi"}]
    fmt = PromptFormat(system_prompt="Be brief.")
    assert fmt.ids(tokenizer, own) == _templated(tokenizer, own)


def test_template_kwargs_reach_the_template(data, tokenizer, tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    off = _env(data, tokenizer, chat_template=str(path),
               chat_template_kwargs=("enable_thinking=false",)).eval_prompts(1)[0]
    assert decode(tokenizer, off).endswith("[assistant] <think></think>")
    on = _env(data, tokenizer, chat_template=str(path),
              chat_template_kwargs=("enable_thinking=true",)).eval_prompts(1)[0]
    assert decode(tokenizer, on).endswith("[assistant] ")
    assert EnvConfig(chat_template_kwargs=("a=false", "b=3", "c=x")).template_kwargs() == {
        "a": False, "b": 3, "c": "x"}


def test_generated_tasks_are_templated_and_still_scored(tokenizer):
    """arithmetic and tool: their prompts through the template; a prompt's answer is
    recomputed from its templated text too (e.g. after a restart)."""
    from hybrid_engine.envs import ArithmeticEnv, CalcEnv

    for env in (ArithmeticEnv(tokenizer, seed=1), CalcEnv(tokenizer, seed=1)):
        ids = env.sample_prompts(1)[0]
        text = decode(tokenizer, ids)
        assert text.startswith("user\n") and text.endswith("assistant\n"), text
        fresh = type(env)(tokenizer, seed=2)  # never handed this prompt out
        assert fresh.answer_for(text) == env.answer_for(text)


def test_refusals_name_the_setting(tokenizer, tmp_path):
    from hybrid_engine.models.tokenizer import build_tokenizer

    with pytest.raises(ValueError, match="no such file"):
        PromptFormat(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="env.system_prompt is set but no chat template is in "
                                         "effect \\(the tokenizer has no chat template\\)"):
        PromptFormat(system_prompt="x").check(build_tokenizer())  # raw tokenizers: no template
    bad = tmp_path / "bad.jinja"
    bad.write_text("{{ raise_exception('no user turn allowed') }}")
    with pytest.raises(ValueError, match="failed to render a prompt: .*no user turn allowed"):
        PromptFormat(str(bad)).check(tokenizer)
    with pytest.raises(ValueError, match="needs a chat template; env.chat_template=none"):
        PromptFormat("none").ids(tokenizer, [{"role": "user", "content": "hi"}])
