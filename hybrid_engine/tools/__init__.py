"""Tools for agentic RL: Python functions the model calls, and parsers of its calls.

`functions`: `load_tools(spec)` -> `Tool`s (name, fn, the JSON schema a chat
template takes), `validate_call` / `validate_arguments`, `call_tool`.
`parsers`: `tool_parser(name)` -> a `ToolParser` whose `parse(text)` gives a
`ParsedTurn` (content, `ToolCall`s, errors); hermes, mistral, llama3_json and
calc (the calculator environment's tags) are registered.
`sandbox`: `run_python(code)` / `Sandbox.run` run a model's code in a separate,
limited, isolated process (or at a SandboxFusion service); `python` is the
built-in tool over it.

Invariant: light and low (transformers at most, lazily; never vLLM, rollout/,
policy/ or roles/), so an environment or a tool worker process can import it.
"""

from hybrid_engine.tools.functions import (
    Tool,
    call_tool,
    load_tools,
    make_tool,
    validate_arguments,
    validate_call,
)
from hybrid_engine.tools.parsers import (
    PARSERS,
    ParsedTurn,
    ToolCall,
    ToolParser,
    register_tool_parser,
    tool_parser,
)

__all__ = ["PARSERS", "ParsedTurn", "Tool", "ToolCall", "ToolParser", "call_tool",
           "load_tools", "make_tool", "register_tool_parser", "tool_parser",
           "validate_arguments", "validate_call"]
