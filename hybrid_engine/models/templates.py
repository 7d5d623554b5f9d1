"""Chat templates with tools, for the tiny models' tokenizer and for tests.

Job: `HERMES_TOOLS_TEMPLATE`, a ChatML template with the structure of Qwen2.5's
public one (written by hand from it): with `tools`, a system turn lists each
tool's JSON schema inside <tools></tools> and asks for
`<tool_call>{"name": ..., "arguments": ...}</tool_call>`; an assistant message's
`tool_calls` render as such blocks after its content; consecutive `tool`
messages render as `<tool_response>` blocks inside one user turn. Without
tools it renders like `hybrid_engine.models.tokenizer.CHAT_TEMPLATE`.
`HERMES_NAMES_TEMPLATE` is the same but lists the tools by name only.

Invariant: an assistant message with tool_calls renders to text the `hermes`
parser of `hybrid_engine.tools.parsers` reads back to the same names and
arguments (tests/tools/test_functions.py).
"""

from __future__ import annotations

__all__ = ["HERMES_NAMES_TEMPLATE", "HERMES_TOOLS_TEMPLATE"]

_SYSTEM_WITH_SCHEMAS = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name "
    "and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    "{\"name\": <function-name>, \"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
)

_SYSTEM_WITH_NAMES = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n' }}{%- endif %}"
    "{{- '<tools>' }}"
    "{%- for tool in tools %}{%- if not loop.first %}{{- ',' }}{%- endif %}"
    "{{- tool.function.name if tool.function is defined else tool.name }}{%- endfor %}"
    "{{- '</tools><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
)

_MESSAGES = (
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first)"
    " or (message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant' }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + tool_call.name + '\", \"arguments\": ' }}"
    "{{- tool_call.arguments | tojson }}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

HERMES_TOOLS_TEMPLATE = _SYSTEM_WITH_SCHEMAS + _MESSAGES
"""Qwen2.5-style ChatML with tools (hermes call format); pass as `chat_template=`."""

HERMES_NAMES_TEMPLATE = _SYSTEM_WITH_NAMES + _MESSAGES
"""The same with the tools listed by name only (`<tools>calculator</tools>`): a
prompt short enough for the CPU tool demo's 4M-parameter model."""
