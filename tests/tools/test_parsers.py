"""Tool-call parsers: each registered format on a table of model outputs (valid,
several calls, text around them, nested and unicode arguments, whitespace,
malformed calls, unclosed markers, empty output), never raising on any prefix of
an output; an unknown tool and wrong argument types caught by `validate_call`
against real tools' schemas; the registry and its error."""

from __future__ import annotations

import json

import pytest

from hybrid_engine.names import Registry
from hybrid_engine.tools import (
    PARSERS,
    ParsedTurn,
    ToolCall,
    load_tools,
    parsers,
    register_tool_parser,
    tool_parser,
    validate_call,
)

NESTED = {"filter": {"tags": ["a", "b"], "range": {"from": 1, "to": [2, 3]}}, "deep": [[{}]]}
UNICODE = {"city": "Zürich", "note": "東京 ☀️ naïve — ok"}
VALUES = {"n": -1.5e3, "ok": True, "none": None, "list": [1, "x", False], "empty": ""}


def _json(obj: object, **kw: object) -> str:
    return json.dumps(obj, **{"ensure_ascii": False, **kw})


def H(name: str, args: object, **kw: object) -> str:  # noqa: N802 - a table constructor
    """A hermes call as Qwen's template writes it."""
    return f"<tool_call>\n{_json({'name': name, 'arguments': args}, **kw)}\n</tool_call>"


def M(name: str, args: object) -> str:  # noqa: N802
    """A v11+ mistral call."""
    return f"[TOOL_CALLS]{name}[ARGS]{_json(args)}"


def L(name: str, args: object, **kw: object) -> str:  # noqa: N802
    """A llama3_json call."""
    return _json({"name": name, "parameters": args}, **kw)


def E(*fragments: str) -> tuple[str, ...]:  # noqa: N802
    """Expected errors: one fragment each, in order."""
    return fragments


W = {"city": "Paris"}
C1, C2 = ("get_weather", W), ("add", {"a": 1, "b": 2})

# (id, text, content, calls as (name, args), error fragments)
HERMES = [
    ("one", H(*C1), "", [C1], E()),
    ("two", H(*C1) + "\n" + H(*C2), "", [C1, C2], E()),
    ("three_adjacent", H(*C1) + H(*C2) + H(*C1), "", [C1, C2, C1], E()),
    ("text_before", "Let me check.\n" + H(*C1), "Let me check.", [C1], E()),
    ("text_after", H(*C1) + "\nDone.", "Done.", [C1], E()),
    ("text_between", H(*C1) + "\nand\n" + H(*C2), "and", [C1, C2], E()),
    ("text_all_around", "a " + H(*C1) + " b " + H(*C2) + " c", "a\nb\nc", [C1, C2], E()),
    ("thinking_first", "<think>\nweather?\n</think>\n\n" + H(*C1),
     "<think>\nweather?\n</think>", [C1], E()),
    ("nested", H("f", NESTED), "", [("f", NESTED)], E()),
    ("unicode", H("f", UNICODE), "", [("f", UNICODE)], E()),
    ("unicode_escaped", H("f", UNICODE, ensure_ascii=True), "", [("f", UNICODE)], E()),
    ("json_values", H("f", VALUES), "", [("f", VALUES)], E()),
    ("compact", '<tool_call>{"name":"f","arguments":{"x":1}}</tool_call>', "",
     [("f", {"x": 1})], E()),
    ("pretty", H("f", NESTED, indent=2), "", [("f", NESTED)], E()),
    ("crlf_tabs", '<tool_call>\r\n\t{"name": "f",\r\n "arguments": {}}\t\r\n</tool_call>', "",
     [("f", {})], E()),
    ("arguments_first", '<tool_call>{"arguments": {"x": 1}, "name": "f"}</tool_call>', "",
     [("f", {"x": 1})], E()),
    ("empty_arguments", H("now", {}), "", [("now", {})], E()),
    ("malformed_brace", '<tool_call>{"name": "f", "arguments": {"x": 1}</tool_call>', "", [],
     E("invalid JSON")),
    ("trailing_comma", '<tool_call>{"name": "f", "arguments": {"x": 1,}}</tool_call>', "", [],
     E("invalid JSON")),
    ("single_quotes", "<tool_call>{'name': 'f', 'arguments': {}}</tool_call>", "", [],
     E("invalid JSON")),
    ("trailing_junk", '<tool_call>{"name": "f", "arguments": {}} extra</tool_call>', "", [],
     E("invalid JSON")),
    ("empty_body", "<tool_call>\n</tool_call>", "", [], E("invalid JSON")),
    ("missing_name", '<tool_call>{"arguments": {"x": 1}}</tool_call>', "", [], E("no name")),
    ("name_not_string", '<tool_call>{"name": 3, "arguments": {}}</tool_call>', "", [],
     E("no name")),
    ("empty_name", '<tool_call>{"name": " ", "arguments": {}}</tool_call>', "", [],
     E("no name")),
    ("arguments_string", H("f", '{"x": 1}'), "", [], E("must be a JSON object, got a string")),
    ("arguments_array", H("f", [1, 2]), "", [], E("must be a JSON object, got an array")),
    ("arguments_missing", '<tool_call>{"name": "f"}</tool_call>', "", [], E("has no 'arguments'")),
    ("body_array", '<tool_call>[{"name": "f", "arguments": {}}]</tool_call>', "", [],
     E("got an array")),
    ("unclosed_whole_json", 'ok <tool_call>\n{"name": "f", "arguments": {"x": 1}}\n', "ok",
     [("f", {"x": 1})], E()),
    ("unclosed_truncated", 'ok <tool_call>\n{"name": "f", "argu', "ok", [],
     E("unclosed <tool_call> and invalid JSON")),
    ("good_bad_good", H(*C1) + "<tool_call>{oops}</tool_call>" + H(*C2), "", [C1, C2],
     E("tool call 2: invalid JSON")),
    ("stray_close_tag", "no call </tool_call> here", "no call </tool_call> here", [], E()),
    ("plain_text", "The answer is 4.", "The answer is 4.", [], E()),
    ("empty", "", "", [], E()),
    ("whitespace_only", " \n\t ", "", [], E()),
]

MISTRAL = [
    ("array_one", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]', "",
     [C1], E()),
    ("array_two", "[TOOL_CALLS]" + _json([{"name": n, "arguments": a} for n, a in (C1, C2)]), "",
     [C1, C2], E()),
    ("bare_object", '[TOOL_CALLS] {"name": "add", "arguments": {"a": 1, "b": 2}}', "", [C2], E()),
    ("array_text_before", 'Sure.[TOOL_CALLS][{"name": "f", "arguments": {}}]', "Sure.",
     [("f", {})], E()),
    ("array_text_after", '[TOOL_CALLS][{"name": "f", "arguments": {}}] then this', "then this",
     [("f", {})], E()),
    ("array_whitespace", '[TOOL_CALLS]\n [\n  {"name": "f",\n   "arguments": {"x": 1}}\n ]\n', "",
     [("f", {"x": 1})], E()),
    ("array_nested", "[TOOL_CALLS]" + _json([{"name": "f", "arguments": NESTED}]), "",
     [("f", NESTED)], E()),
    ("array_unicode", "[TOOL_CALLS]" + _json([{"name": "f", "arguments": UNICODE}]), "",
     [("f", UNICODE)], E()),
    ("array_malformed", '[TOOL_CALLS][{"name": "f", "arguments": {"x": 1}]', "", [],
     E("invalid JSON")),
    ("array_missing_name", '[TOOL_CALLS][{"arguments": {}}]', "", [], E("no name")),
    ("array_arguments_string", '[TOOL_CALLS][{"name": "f", "arguments": "{}"}]', "", [],
     E("got a string")),
    ("array_arguments_missing", '[TOOL_CALLS][{"name": "f"}]', "", [], E("has no 'arguments'")),
    ("array_bad_element", '[TOOL_CALLS][3, {"name": "f", "arguments": {}}]', "", [("f", {})],
     E("tool call 1: expected a JSON object")),
    ("array_empty", "[TOOL_CALLS][]", "", [], E("empty array")),
    ("repeated_marker", '[TOOL_CALLS][TOOL_CALLS][{"name": "f", "arguments": {}}]', "",
     [("f", {})], E()),
    ("v11_one", M(*C1), "", [C1], E()),
    ("v11_two", M(*C1) + M(*C2), "", [C1, C2], E()),
    ("v11_brace_separator", '[TOOL_CALLS]f{"x": 1}', "", [("f", {"x": 1})], E()),
    ("v11_call_id", '[TOOL_CALLS]f[CALL_ID]a1B2c3D4e[ARGS]{"x": 1}', "", [("f", {"x": 1})], E()),
    ("v11_text_before", "Checking the weather.\n" + M(*C1), "Checking the weather.", [C1], E()),
    ("v11_text_after", M(*C1) + " and that is all", "and that is all", [C1], E()),
    ("v11_nested", M("f", NESTED), "", [("f", NESTED)], E()),
    ("v11_unicode", M("f", UNICODE), "", [("f", UNICODE)], E()),
    ("v11_values", M("f", VALUES), "", [("f", VALUES)], E()),
    ("v11_whitespace", '[TOOL_CALLS] f [ARGS] \n{"x": 1}\n', "", [("f", {"x": 1})], E()),
    ("v11_missing_name", "[TOOL_CALLS][ARGS]{}", "", [], E("no name")),
    ("v11_malformed", '[TOOL_CALLS]f[ARGS]{"x": 1', "", [], E("arguments of 'f': invalid JSON")),
    ("v11_args_array", "[TOOL_CALLS]f[ARGS][1, 2]", "", [], E("must be a JSON object")),
    ("v11_name_only", "[TOOL_CALLS]get_weather", "", [], E("has no arguments")),
    ("v11_good_bad", M(*C1) + "[TOOL_CALLS]f[ARGS]{bad}" + M(*C2), "", [C1, C2],
     E("tool call 2: arguments of 'f'")),
    ("marker_alone", "Let me see [TOOL_CALLS]", "Let me see", [], E("nothing after")),
    ("plain_text", "No tools needed: 4.", "No tools needed: 4.", [], E()),
    ("empty", "", "", [], E()),
    ("whitespace_only", "\n \n", "", [], E()),
]

LLAMA = [
    ("one", L(*C1), "", [C1], E()),
    ("python_tag", "<|python_tag|>" + L(*C1), "", [C1], E()),
    ("arguments_key", _json({"name": "add", "arguments": {"a": 1, "b": 2}}), "", [C2], E()),
    ("two_semicolon", L(*C1) + "; " + L(*C2), "", [C1, C2], E()),
    ("three_newlines", L(*C1) + ";\n" + L(*C2) + " ;\n" + L(*C1), "", [C1, C2, C1], E()),
    ("tag_two", "<|python_tag|>" + L(*C1) + ";" + L(*C2), "", [C1, C2], E()),
    ("trailing_semicolon", L(*C1) + ";", "", [C1], E()),
    ("text_before", "I will call a tool.\n" + L(*C1), "I will call a tool.", [C1], E()),
    ("text_before_tag", "Calling:<|python_tag|>" + L(*C1), "Calling:", [C1], E()),
    ("text_after", L(*C1) + "\nthat's it", "that's it", [C1], E()),
    ("text_between", L(*C1) + "\nthen\n" + L(*C2), "then", [C1, C2], E()),
    ("nested", L("f", NESTED), "", [("f", NESTED)], E()),
    ("unicode", L("f", UNICODE), "", [("f", UNICODE)], E()),
    ("unicode_escaped", L("f", UNICODE, ensure_ascii=True), "", [("f", UNICODE)], E()),
    ("values", L("f", VALUES), "", [("f", VALUES)], E()),
    ("spaces_in_key", '{ "name" : "f" , "parameters" : { "x" : 1 } }', "", [("f", {"x": 1})],
     E()),
    ("pretty", "\n\n" + L("f", NESTED, indent=2) + "\n", "", [("f", NESTED)], E()),
    ("parameters_first", '{"parameters": {"x": 1}, "name": "f"}', "", [("f", {"x": 1})], E()),
    ("empty_parameters", L("now", {}), "", [("now", {})], E()),
    ("malformed", '{"name": "f", "parameters": {"x": 1}', "", [], E("invalid JSON")),
    ("malformed_then_good", '{"name": "f", "parameters": {"x": 1};' + L(*C2), "", [C2],
     E("tool call 1: invalid JSON")),
    ("single_quotes", "{'name': 'f', 'parameters': {}}", "{'name': 'f', 'parameters': {}}", [],
     E()),
    ("missing_name", '{"parameters": {"x": 1}}', "", [], E("no name")),
    ("name_not_string", '{"name": ["f"], "parameters": {}}', "", [], E("no name")),
    ("parameters_string", '{"name": "f", "parameters": "x=1"}', "", [], E("got a string")),
    ("parameters_missing", '{"name": "f"}', "", [], E("has no 'parameters'")),
    ("braces_in_text", "The set {1, 2} has 2 elements.", "The set {1, 2} has 2 elements.", [],
     E()),
    ("other_json", 'Result: {"answer": 4}', 'Result: {"answer": 4}', [], E()),
    ("name_not_first_key", '{"type": "function", "name": "f", "parameters": {}}',
     '{"type": "function", "name": "f", "parameters": {}}', [], E()),
    ("tag_without_json", '<|python_tag|>brave_search.call(query="x")',
     'brave_search.call(query="x")', [], E("not followed by a JSON call")),
    ("plain_text", "It is 4.", "It is 4.", [], E()),
    ("empty", "", "", [], E()),
    ("whitespace_only", "  \n", "", [], E()),
]

TABLES = {"hermes": HERMES, "mistral": MISTRAL, "llama3_json": LLAMA}
CASES = [pytest.param(name, *row[1:], id=f"{name}-{row[0]}")
         for name, rows in TABLES.items() for row in rows]


def test_each_parser_has_at_least_30_cases() -> None:
    assert {name: len(rows) >= 30 for name, rows in TABLES.items()} == dict.fromkeys(TABLES, True)


@pytest.mark.parametrize("parser, text, content, calls, errors", CASES)
def test_parse(parser: str, text: str, content: str, calls: list, errors: tuple) -> None:
    got = tool_parser(parser).parse(text)
    assert isinstance(got, ParsedTurn)
    assert got.content == content
    assert got.calls == tuple(ToolCall(n, a) for n, a in calls)
    assert len(got.errors) == len(errors), got.errors
    for error, fragment in zip(got.errors, errors):
        assert fragment in error, got.errors
    if got.calls or got.errors:
        assert tool_parser(parser).may_call(text)


@pytest.mark.parametrize("parser", sorted(TABLES))
def test_no_call_marker_means_no_call(parser: str) -> None:
    p = tool_parser(parser)
    for text in ("", "plain words", "a [list] of <tags>", "x = (1, 2)"):
        assert not p.may_call(text)
        assert p.parse(text).calls == () and p.parse(text).errors == ()


@pytest.mark.parametrize("parser", sorted(TABLES))
def test_no_prefix_of_an_output_makes_a_parser_raise(parser: str) -> None:
    """A generation cut at any character (the token limit) is parsed, never raised on."""
    p = tool_parser(parser)
    texts = [row[1] for row in TABLES[parser] if row[0].startswith(("text_all", "two", "v11_two",
                                                                    "array_two", "nested"))]
    texts += ["<tool_call>[TOOL_CALLS]<|python_tag|>{", "}]\x00\ud800", "[" * 50 + "{" * 50]
    for text in texts:
        for end in range(len(text) + 1):
            assert isinstance(p.parse(text[:end]), ParsedTurn)


@pytest.mark.parametrize("parser, fmt", [("hermes", H), ("mistral", M), ("llama3_json", L)])
def test_json_that_python_refuses_to_decode_is_an_error(parser: str, fmt: object) -> None:
    """An integer past sys.get_int_max_str_digits() (ValueError, not JSONDecodeError)
    and arrays nested past the recursion limit are malformed calls, not exceptions."""
    huge = fmt("f", {"x": 0}).replace('{"x": 0}', '{"x": ' + "1" * 5000 + "}")
    deep = fmt("f", {"x": 0}).replace('{"x": 0}', '{"x": ' + "[" * 100_000 + "}")
    assert tool_parser(parser).parse(huge).errors[0].startswith(
        "tool call 1: " + ("arguments of 'f': " if parser == "mistral" else "")
        + "invalid JSON: Exceeds the limit")
    assert len(tool_parser(parser).parse(deep).errors) == 1


@pytest.fixture(scope="module")
def tools() -> list:
    return load_tools("tests.tools.sample_tools:get_weather,add,search")


@pytest.mark.parametrize("parser, text", [
    ("hermes", H("get_wether", W)), ("mistral", M("get_wether", W)),
    ("llama3_json", L("get_wether", W)),
])
def test_a_call_to_an_unknown_tool_parses_and_validate_call_refuses_it(tools, parser: str,
                                                                       text: str) -> None:
    (call,) = tool_parser(parser).parse(text).calls
    assert validate_call(tools, call.name, call.arguments) == (
        "unknown tool 'get_wether'; available: get_weather, add, search")


WRONG_TYPES = [
    ("get_weather", {"city": 3}, "argument 'city' must be string, got integer"),
    ("get_weather", {"city": "Oslo", "days": "2"}, "argument 'days' must be integer, got string"),
    ("get_weather", {"city": "Oslo", "days": 1.5}, "argument 'days' must be integer, got number"),
    ("get_weather", {"city": "Oslo", "unit": "k"}, "argument 'unit' must be one of"),
    ("add", {"a": True, "b": 1}, "argument 'a' must be number, got boolean"),
    ("search", {"query": "q", "tags": ["a", 2]}, "argument 'tags'[1] must be string, got integer"),
    ("search", {"query": "q", "limits": {"web": "x"}}, "argument 'limits'['web'] must be integer"),
]


@pytest.mark.parametrize("parser, fmt", [("hermes", H), ("mistral", M), ("llama3_json", L)])
def test_wrong_argument_types_parse_and_validate_call_names_them(tools, parser: str,
                                                                 fmt: object) -> None:
    for name, args, why in WRONG_TYPES:
        (call,) = tool_parser(parser).parse(fmt(name, args)).calls
        assert call == ToolCall(name, args)
        assert why in validate_call(tools, call.name, call.arguments)
    (ok,) = tool_parser(parser).parse(fmt("search", {"query": "q", "tags": None})).calls
    assert validate_call(tools, ok.name, ok.arguments) is None


def test_unknown_parser_lists_the_registered_ones() -> None:
    with pytest.raises(ValueError, match="^env.tool_parser: unknown tool parser 'hermess'; did "
                                         "you mean 'hermes'[?] available: calc, hermes, "
                                         "llama3_json, mistral$"):
        tool_parser("hermess")
    with pytest.raises(ValueError, match="^unknown tool parser 'xml'; available: calc, hermes, "):
        PARSERS.get("xml")  # the config's check_registered adds the key
    assert PARSERS.names() == ["calc", "hermes", "llama3_json", "mistral"] and "hermes" in PARSERS


def test_a_parser_is_added_with_one_decorated_function(monkeypatch) -> None:
    monkeypatch.setattr(parsers, "PARSERS", Registry("tool parser"))

    @register_tool_parser("call_lines", call_starts=("CALL ",))
    def parse(text: str) -> ParsedTurn:
        calls = [ToolCall(line[5:], {}) for line in text.splitlines() if line.startswith("CALL ")]
        rest = [line for line in text.splitlines() if not line.startswith("CALL ")]
        return ParsedTurn("\n".join(rest), tuple(calls), ())

    p = tool_parser("call_lines")
    assert (p.name, p.call_starts) == ("call_lines", ("CALL ",))
    assert p.parse("hi\nCALL now") == ParsedTurn("hi", (ToolCall("now", {}),), ())
    with pytest.raises(AssertionError, match="registered twice"):
        register_tool_parser("call_lines", call_starts=("x",))(parse)


@pytest.mark.parametrize("text, content, expressions", [
    ("<calc>12*7</calc>", "", ["12*7"]),
    ("Let me see <calc> 12 * 7 </calc>", "Let me see", ["12 * 7"]),
    ("<calc>1+1</calc> and <calc>2*3</calc> then", "and\nthen", ["1+1", "2*3"]),
    ("<calc>(1+2</calc>", "", ["(1+2"]),  # the calculator reports the bad expression
    ("<calc>1+1", "<calc>1+1", []),  # unclosed: text
    ("1+1 is 2", "1+1 is 2", []),
    ("<calc></calc>", "", [""]),
    ("<calc>a\nb</calc>", "", ["a\nb"]),
])
def test_calc_tags_are_calculator_calls(text: str, content: str, expressions: list) -> None:
    got = tool_parser("calc").parse(text)
    assert got.content == content and got.errors == ()
    assert got.calls == tuple(ToolCall("calculator", {"expression": e}) for e in expressions)
    assert tool_parser("calc").may_call(text) == ("<calc>" in text)
