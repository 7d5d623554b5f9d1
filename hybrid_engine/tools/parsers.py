"""Tool-call parsers: an assistant turn's text -> its content and its tool calls.

Job: `tool_parser(name).parse(text)` splits what the model wrote into the text
outside its calls, the well-formed calls (`ToolCall`: a name and an arguments
object) and one error text per malformed call, in the format a model family
was trained on. Parsers are looked up by name in `PARSERS` (the registry
`env.tool_parser` names); a new one is one decorated function
(`register_tool_parser`). Each names `call_starts`, strings at least
one of which any text holding a call contains, so a rollout can tell cheaply
that a segment has none.

Formats (read from vLLM's parsers, vllm/tool_parsers/hermes_tool_parser.py,
llama_tool_parser.py and vllm/parser/mistral.py, vLLM 0.32):

- hermes (Qwen2.5, Qwen3, Hermes): `<tool_call>{"name": ..., "arguments": {...}}
  </tool_call>`, any number per turn, text around them. A last `<tool_call>`
  left open still counts when its body is a whole JSON object, as in vLLM (a
  rollout that stops at "</tool_call>" without keeping it gets that text).
- mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (tokenizers
  before v11; a bare object too), or `[TOOL_CALLS]name[ARGS]{...}` repeated
  (v11 and later; `name{...}` and `name[CALL_ID]id[ARGS]{...}` as well). Text before the first
  marker and after a call's JSON is content.
- llama3_json (Llama 3.1 / 3.2): a JSON object `{"name": ..., "parameters":
  {...}}` ("arguments" accepted too), optionally after `<|python_tag|>`,
  several separated by ";". An object counts as a call when its first key is
  name, parameters or arguments; other JSON is content.
- calc (the calculator environment's own tags, not a model family's):
  `<calc>EXPR</calc>` is a call of the `calculator` tool with that expression;
  an unclosed `<calc>` is text.

Invariant: `parse` never raises on model output; a call needs a non-empty
string name and an arguments object (`{}` for a tool without arguments); a
malformed call is an error, never a call, and never content.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hybrid_engine.names import Registry

__all__ = ["PARSERS", "ParsedTurn", "ToolCall", "ToolParser",
           "register_tool_parser", "tool_parser"]

_DECODER = json.JSONDecoder()


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One well-formed call: the tool's name and its arguments (a JSON object)."""

    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True, slots=True)
class ParsedTurn:
    """What an assistant turn holds.

    Fields:
        content: the text outside the calls, each piece stripped, joined by
            "\\n" ("" when none).
        calls: the well-formed calls, in order.
        errors: one text per malformed call, in order ("tool call 2: ...").
    """

    content: str
    calls: tuple[ToolCall, ...]
    errors: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class ToolParser:
    """A registered format.

    Fields:
        name: its registry name ("hermes").
        call_starts: a text that contains none of these holds no call (a
            necessary condition only: "{" for llama3_json).
        parse: text -> ParsedTurn; never raises.
    """

    name: str
    call_starts: tuple[str, ...]
    parse: Callable[[str], ParsedTurn]

    def may_call(self, text: str) -> bool:
        """False when text certainly holds no call."""
        return any(s in text for s in self.call_starts)


PARSERS: Registry[ToolParser] = Registry("tool parser")


def register_tool_parser(name: str, call_starts: tuple[str, ...]
                         ) -> Callable[[Callable[[str], ParsedTurn]], Callable[[str], ParsedTurn]]:
    """Decorator: registers `parse(text) -> ParsedTurn` under name (once), with the
    strings that mark a call's start."""

    def deco(parse: Callable[[str], ParsedTurn]) -> Callable[[str], ParsedTurn]:
        PARSERS.add(name, ToolParser(name, tuple(call_starts), parse))
        return parse

    return deco


def tool_parser(name: str, key: str = "env.tool_parser") -> ToolParser:
    """The parser registered as name.

    Raises:
        ValueError: unknown name, naming the key; lists the registered ones.
    """
    try:
        return PARSERS.get(name)
    except ValueError as exc:
        raise ValueError(f"{key}: {exc}") from None


class _Turn:
    """Accumulates a ParsedTurn: content pieces, calls and numbered errors."""

    def __init__(self) -> None:
        self.pieces: list[str] = []
        self.calls: list[ToolCall] = []
        self.errors: list[str] = []

    def text(self, piece: str) -> None:
        if piece.strip():
            self.pieces.append(piece.strip())

    def call(self, obj: Any, args_keys: tuple[str, ...] = ("arguments",)) -> None:
        """Adds obj as a call, or the reason it is none as an error."""
        why = _call_error(obj, args_keys)
        if why is None:
            args = next(obj[k] for k in args_keys if k in obj)
            self.calls.append(ToolCall(obj["name"], args))
        else:
            self.error(why)

    def error(self, why: str) -> None:
        self.errors.append(f"tool call {len(self.calls) + len(self.errors) + 1}: {why}")

    def done(self) -> ParsedTurn:
        return ParsedTurn("\n".join(self.pieces), tuple(self.calls), tuple(self.errors))


def _call_error(obj: Any, args_keys: tuple[str, ...]) -> str | None:
    """Why obj is not {"name": str, <args key>: object}, or None."""
    if not isinstance(obj, dict):
        return f"expected a JSON object with a name and {args_keys[0]}, got {_kind(obj)}"
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return "the call has no name (a non-empty string under \"name\")"
    key = next((k for k in args_keys if k in obj), None)
    if key is None:
        return f"call to {name!r} has no {args_keys[0]!r} (use {{}} for none)"
    if not isinstance(obj[key], dict):
        return f"{key} of {name!r} must be a JSON object, got {_kind(obj[key])}"
    return None


def _kind(value: Any) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean",
             int: "a number", float: "a number", type(None): "null"}
    return names.get(type(value), type(value).__name__)


# What decoding model text can raise: JSONDecodeError, ValueError (an integer past
# sys.get_int_max_str_digits()), RecursionError (arrays nested thousands deep).
_JSON_ERRORS = (ValueError, RecursionError)


def _bad_json(exc: Exception) -> str:
    if isinstance(exc, json.JSONDecodeError):
        return f"invalid JSON: {exc.msg} (line {exc.lineno} column {exc.colno})"
    return f"invalid JSON: {str(exc).split(';')[0]}"


def _decode_prefix(text: str) -> tuple[Any, int]:
    """The JSON value at the start of text (leading whitespace skipped) and where it ends."""
    start = len(text) - len(text.lstrip())
    return _DECODER.raw_decode(text, start)


# --------------------------------------------------------------------------
# hermes
# --------------------------------------------------------------------------

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"


@register_tool_parser("hermes", call_starts=(HERMES_OPEN,))
def parse_hermes(text: str) -> ParsedTurn:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks amid text."""
    turn, pos = _Turn(), 0
    while (start := text.find(HERMES_OPEN, pos)) >= 0:
        turn.text(text[pos:start])
        body_at = start + len(HERMES_OPEN)
        end = text.find(HERMES_CLOSE, body_at)
        body = text[body_at:] if end < 0 else text[body_at:end]
        pos = len(text) if end < 0 else end + len(HERMES_CLOSE)
        try:
            turn.call(json.loads(body))
        except _JSON_ERRORS as exc:
            unclosed = f"unclosed {HERMES_OPEN} and " if end < 0 else ""
            turn.error(f"{unclosed}{_bad_json(exc)}")
    turn.text(text[pos:])
    return turn.done()


# --------------------------------------------------------------------------
# mistral
# --------------------------------------------------------------------------

MISTRAL_CALLS, MISTRAL_ARGS = "[TOOL_CALLS]", "[ARGS]"
_MISTRAL_NAME = re.compile(r"\s*([^\s\[{]*)\s*(?:\[CALL_ID\]\s*\w*\s*)?(\[ARGS\])?")


def _mistral_segment(turn: _Turn, segment: str) -> None:
    """One `[TOOL_CALLS]...` segment: a JSON array/object, or name[ARGS]{...}."""
    if segment.lstrip().startswith(("[", "{")) and not segment.lstrip().startswith(MISTRAL_ARGS):
        try:
            value, end = _decode_prefix(segment)
        except _JSON_ERRORS as exc:
            turn.error(_bad_json(exc))
            return
        if value == []:
            turn.error(f"an empty array after {MISTRAL_CALLS}")
        for obj in value if isinstance(value, list) else [value]:
            turn.call(obj)
        turn.text(segment[end:])
        return
    match = _MISTRAL_NAME.match(segment)
    name, rest = match.group(1), segment[match.end():]
    if not name:
        turn.error("the call has no name (expected [TOOL_CALLS]name[ARGS]{...})")
        return
    if not rest.strip():
        turn.error(f"call to {name!r} has no arguments (expected {MISTRAL_ARGS}{{...}})")
        return
    try:
        args, end = _decode_prefix(rest)
    except _JSON_ERRORS as exc:
        turn.error(f"arguments of {name!r}: {_bad_json(exc)}")
        return
    turn.call({"name": name, "arguments": args})
    turn.text(rest[end:])


@register_tool_parser("mistral", call_starts=(MISTRAL_CALLS,))
def parse_mistral(text: str) -> ParsedTurn:
    """`[TOOL_CALLS][{...}, ...]` or `[TOOL_CALLS]name[ARGS]{...}` (repeated)."""
    turn = _Turn()
    head, *segments = text.split(MISTRAL_CALLS)
    turn.text(head)
    segments = [s for s in segments if s.strip()]  # repeated markers count as one
    if MISTRAL_CALLS in text and not segments:
        turn.error(f"nothing after {MISTRAL_CALLS}")
    for segment in segments:
        _mistral_segment(turn, segment)
    return turn.done()


# --------------------------------------------------------------------------
# llama3_json
# --------------------------------------------------------------------------

PYTHON_TAG = "<|python_tag|>"
_LLAMA_START = re.compile(r'\{\s*"(?:name|parameters|arguments)"\s*:')
_LLAMA_NEXT = re.compile(r';\s*(?=\{\s*"(?:name|parameters|arguments)"\s*:)')


@register_tool_parser("llama3_json", call_starts=(PYTHON_TAG, "{"))
def parse_llama3_json(text: str) -> ParsedTurn:
    """`{"name": ..., "parameters": {...}}` objects, `;`-separated, after an optional tag."""
    turn, pos = _Turn(), 0
    tagged = PYTHON_TAG in text
    text = text.replace(PYTHON_TAG, " ")
    while (match := _LLAMA_START.search(text, pos)) is not None:
        turn.text(text[pos:match.start()])
        try:
            obj, end = _DECODER.raw_decode(text, match.start())
            turn.call(obj, ("parameters", "arguments"))
            pos = end
            sep = re.match(r"\s*;", text[pos:])
            pos += sep.end() if sep else 0
        except _JSON_ERRORS as exc:
            turn.error(_bad_json(exc))
            skip = _LLAMA_NEXT.search(text, match.end())  # the malformed call ends at the next
            pos = skip.end() if skip else len(text)
    turn.text(text[pos:])
    if tagged and not turn.calls and not turn.errors:
        turn.error(f"{PYTHON_TAG} is not followed by a JSON call "
                   '{"name": ..., "parameters": {...}}')
    return turn.done()


# --------------------------------------------------------------------------
# calc
# --------------------------------------------------------------------------

CALC_OPEN, CALC_CLOSE = "<calc>", "</calc>"
_CALC = re.compile(re.escape(CALC_OPEN) + "(.*?)" + re.escape(CALC_CLOSE), re.DOTALL)


@register_tool_parser("calc", call_starts=(CALC_OPEN,))
def parse_calc(text: str) -> ParsedTurn:
    """`<calc>EXPR</calc>` tags amid text: calls of `calculator(expression=EXPR)`."""
    turn, pos = _Turn(), 0
    for match in _CALC.finditer(text):
        turn.text(text[pos:match.start()])
        turn.call({"name": "calculator", "arguments": {"expression": match[1].strip()}})
        pos = match.end()
    turn.text(text[pos:])
    return turn.done()
