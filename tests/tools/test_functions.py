"""Tools as Python functions: loaded from a file and from a module with
get_json_schema's schema, each loading error one ValueError naming the key and
the function, arguments checked against the schema, results as text; and the
tools rendered by a real tokenizer through the hermes chat template, whose
assistant tool calls the hermes parser reads back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers.utils import get_json_schema

from hybrid_engine.models.templates import HERMES_TOOLS_TEMPLATE
from hybrid_engine.tools import (
    Tool,
    ToolCall,
    call_tool,
    load_tools,
    make_tool,
    tool_parser,
    validate_arguments,
    validate_call,
)
from hybrid_engine.user_code import load_function
from tests.tools import sample_tools

SAMPLE = Path(sample_tools.__file__)
MODULE = "tests.tools.sample_tools"


def test_tools_load_from_a_file_with_get_json_schemas_schema() -> None:
    tools = load_tools(f"{SAMPLE}:get_weather,add")
    assert [t.name for t in tools] == ["get_weather", "add"]
    assert tools[0].schema == get_json_schema(sample_tools.get_weather)
    assert tools[1].schema == get_json_schema(sample_tools.add)
    assert tools[0].fn.__globals__ is tools[1].fn.__globals__  # the file is imported once
    assert tools[0].parameters["required"] == ["city"]
    assert tools[0].spec == f"{SAMPLE.resolve()}:get_weather"
    assert load_function(tools[1].spec, "env.tools")(1, 2) == 3  # a worker's way to it


def test_tools_load_from_a_module_and_from_several_specs(tmp_path) -> None:
    (tmp_path / "extra.py").write_text(
        'def shout(text: str) -> str:\n    """Upper case.\n\n    Args:\n        text: Words.\n'
        '    """\n    return text.upper()\n')
    tools = load_tools(f"{MODULE}:search,now, {tmp_path / 'extra.py'}:shout")
    assert [t.name for t in tools] == ["search", "now", "shout"]
    assert tools[0].fn is sample_tools.search
    assert tools[1].schema == get_json_schema(sample_tools.now)
    assert call_tool(tools[2], {"text": "hi"}) == "HI"
    assert tools[0].spec == f"{MODULE}:search"
    assert make_tool(sample_tools.add) == Tool("add", sample_tools.add,
                                               get_json_schema(sample_tools.add), f"{MODULE}:add")


@pytest.mark.parametrize("spec, message", [
    ("missing/tools.py:f", "env.tools='missing/tools.py:f': file 'missing/tools.py' does not exist"),
    (f"{MODULE}:get_weather,nope",
     f"env.tools='{MODULE}:get_weather,nope': '{MODULE}' has no function 'nope'"),
    (f"{MODULE}:NOT_A_FUNCTION", "has no function 'NOT_A_FUNCTION'"),
    ("tests.tools.no_such_module:f", "importing 'tests.tools.no_such_module' failed"),
    (f"{MODULE}:no_hints", "env.tools: function 'no_hints' cannot be a tool (Argument city is "
                           "missing a type hint in function no_hints); give every argument"),
    (f"{MODULE}:no_arg_docs", "function 'no_arg_docs' cannot be a tool (Cannot generate JSON "
                              "schema for no_arg_docs because the docstring has no description "
                              "for the argument 'city')"),
    (f"{MODULE}:add,add", f"env.tools='{MODULE}:add,add': two tools are named 'add'"),
    ("get_weather", "'get_weather' must look like 'path/to/file.py:fn1,fn2', "
                    "'package.module:fn' or a built-in name (python, calculator)"),
    (f"{MODULE}:add,", "'' must look like"),
    (f"{MODULE}:1bad", "'tests.tools.sample_tools:1bad' must look like"),
])
def test_each_loading_error_is_one_value_error_naming_the_key(spec: str, message: str) -> None:
    with pytest.raises(ValueError) as info:
        load_tools(spec)
    assert message in str(info.value)
    assert str(info.value).startswith("env.tools")


def test_the_key_in_messages_is_the_callers(tmp_path) -> None:
    with pytest.raises(ValueError, match=r"^agent.tools='x.py:f': file 'x.py' does not exist"):
        load_tools("x.py:f", key="agent.tools")


def test_two_files_with_one_function_name_are_refused(tmp_path) -> None:
    other = tmp_path / "other.py"
    other.write_text(SAMPLE.read_text())
    with pytest.raises(ValueError, match="two tools are named 'get_weather'"):
        load_tools(f"{SAMPLE}:get_weather,{other}:get_weather")


@pytest.fixture(scope="module")
def tools() -> dict[str, Tool]:
    return {t.name: t for t in load_tools(f"{MODULE}:get_weather,add,search,now")}


@pytest.mark.parametrize("name, arguments, error", [
    ("get_weather", {"city": "Oslo"}, None),
    ("get_weather", {"city": "Oslo", "days": 3, "unit": "f"}, None),
    ("add", {"a": 1, "b": 2.5}, None),
    ("search", {"query": "q", "tags": ["x"], "limits": {"web": 3}, "exact": True}, None),
    ("search", {"query": "q", "tags": None, "limits": None}, None),
    ("now", {}, None),
    ("get_weather", {}, "get_weather: missing required argument 'city'"),
    ("add", {"b": 1}, "add: missing required argument 'a'"),
    ("get_weather", {"city": "Oslo", "town": "x"},
     "get_weather: unknown argument 'town'; it takes 'city', 'days', 'unit'"),
    ("now", {"tz": "UTC"}, "now: unknown argument 'tz'; it takes no arguments"),
    ("get_weather", {"city": None}, "get_weather: argument 'city' must be string, got null"),
    ("get_weather", {"city": ["Oslo"]}, "argument 'city' must be string, got array"),
    ("get_weather", {"city": "Oslo", "days": True}, "argument 'days' must be integer, got boolean"),
    ("get_weather", {"city": "Oslo", "days": 2.0}, "argument 'days' must be integer, got number"),
    ("get_weather", {"city": "Oslo", "unit": "K"},
     'argument \'unit\' must be one of ["c", "f"], got "K"'),
    ("add", {"a": "1", "b": 2}, "add: argument 'a' must be number, got string"),
    ("search", {"query": "q", "exact": "yes"}, "argument 'exact' must be boolean, got string"),
    ("search", {"query": "q", "tags": "x"}, "argument 'tags' must be array, got string"),
    ("search", {"query": "q", "tags": [None]}, "argument 'tags'[0] must be string, got null"),
    ("search", {"query": "q", "limits": []}, "argument 'limits' must be object, got array"),
    ("search", {"query": "q", "limits": {"a": 1.5}},
     "argument 'limits'['a'] must be integer, got number"),
    ("add", [1, 2], "add: arguments must be a JSON object, got array"),
])
def test_validate_arguments(tools, name: str, arguments: dict, error: str | None) -> None:
    got = validate_arguments(tools[name], arguments)
    assert got is None if error is None else error in got and got.startswith(f"{name}: ")
    assert validate_call(list(tools.values()), name, arguments) == got


def test_validate_call_names_an_unknown_tool(tools) -> None:
    assert validate_call(list(tools.values()), "weather", {}) == (
        "unknown tool 'weather'; available: get_weather, add, search, now")
    assert validate_call([], "weather", {}) == "unknown tool 'weather'; available: none"


def test_call_tool_returns_text_and_lets_exceptions_through(tools) -> None:
    assert call_tool(tools["now"], {}) == "12:00"
    assert json.loads(call_tool(tools["get_weather"], {"city": "Zürich"})) == {
        "city": "Zürich", "days": 1, "unit": "c", "sky": "sunny"}
    assert "Zürich" in call_tool(tools["get_weather"], {"city": "Zürich"})  # not \u-escaped
    assert call_tool(tools["add"], {"a": 1, "b": 2.5}) == "3.5"
    (fails,) = load_tools(f"{MODULE}:fails")
    with pytest.raises(RuntimeError, match="tool broke on 7"):
        call_tool(fails, {"x": 7})


def test_the_built_in_calculator_tool() -> None:
    """env.tools=calculator: the calculator environment's exact integer arithmetic
    as a tool, its schema from its hints and docstring, an error for non-arithmetic."""
    from hybrid_engine.tools.calculator import CalcError

    (calc,) = load_tools("calculator")
    params = calc.schema["function"]["parameters"]
    assert calc.name == "calculator" and params["required"] == ["expression"]
    assert params["properties"]["expression"]["type"] == "string"
    assert call_tool(calc, {"expression": "(12 + 3) * 4"}) == "60"
    assert call_tool(calc, {"expression": "4821 * 37 - 7 / 2"}) == "356747/2"
    with pytest.raises(CalcError, match="unexpected"):
        call_tool(calc, {"expression": "2 ** 8"})


# --------------------------------------------------------------------------
# A real tokenizer and the hermes chat template
# --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from hybrid_engine.models.tokenizer import write_tokenizer_files

    folder = tmp_path_factory.mktemp("tok")
    write_tokenizer_files(folder)
    tok = AutoTokenizer.from_pretrained(folder)
    tok.chat_template = HERMES_TOOLS_TEMPLATE
    return tok


def test_the_template_lists_the_tools_in_the_system_turn(tokenizer, tools) -> None:
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Weather in Oslo?"}]
    text = tokenizer.apply_chat_template(messages, tools=[t.schema for t in tools.values()],
                                         tokenize=False, add_generation_prompt=True)
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    listed = system.split("<tools>\n")[1].split("\n</tools>")[0].splitlines()
    assert [json.loads(line) for line in listed] == [t.schema for t in tools.values()]
    assert text.endswith("<|im_start|>user\nWeather in Oslo?<|im_end|>\n<|im_start|>assistant\n")
    plain = tokenizer.apply_chat_template(messages[1:], tokenize=False)
    assert plain == "<|im_start|>user\nWeather in Oslo?<|im_end|>\n"  # no tools, no system


def test_an_assistant_call_rendered_by_the_template_parses_back(tokenizer, tools) -> None:
    calls = [ToolCall("get_weather", {"city": "Zürich", "days": 2}),
             ToolCall("search", {"query": "umbrella", "tags": ["rain"], "limits": {"web": 3}})]
    messages = [
        {"role": "user", "content": "Weather in Zürich?"},
        {"role": "assistant", "content": "Let me check.", "tool_calls": [
            {"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls]},
        {"role": "tool", "name": "get_weather", "content": "sunny"},
        {"role": "tool", "name": "search", "content": "3 notes"},
    ]
    text = tokenizer.apply_chat_template(messages, tools=[t.schema for t in tools.values()],
                                         tokenize=False, add_generation_prompt=True)
    assistant = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    parsed = tool_parser("hermes").parse(assistant)
    assert parsed.calls == tuple(calls) and parsed.content == "Let me check." and not parsed.errors
    assert all(validate_call(list(tools.values()), c.name, c.arguments) is None for c in calls)
    results = text.split("<|im_start|>user\n")[2].split("<|im_end|>")[0]
    assert results == "<tool_response>\nsunny\n</tool_response>\n" \
                      "<tool_response>\n3 notes\n</tool_response>"
