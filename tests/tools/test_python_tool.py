"""The built-in `python` tool (tools/python.py): its schema, its text, the env.sandbox_*
keys that reach its sandbox (each checked against the default it replaces), a
SandboxFusion-shaped service on localhost (a real HTTP server running the local
sandbox), and a tool call that raises or runs forever inside the tool workers
coming back as the call's result while the episode goes on."""

from __future__ import annotations

import http.server
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hybrid_engine.config import EnvConfig
from hybrid_engine.envs.registry import sandbox
from hybrid_engine.tools.functions import call_tool, load_tools, validate_arguments
from hybrid_engine.tools.sandbox import Sandbox, SandboxError, SandboxLimits, run_python

SAMPLE_TOOLS = Path(__file__).parent / "sample_tools.py"


def test_the_tool_is_named_python_and_the_model_sees_only_its_code() -> None:
    [tool] = load_tools("python")
    assert tool.spec == "hybrid_engine.tools.python:python"
    params = tool.schema["function"]["parameters"]
    assert params["properties"].keys() == {"code"} and params["required"] == ["code"]
    assert tool.settings == {"sandbox": Sandbox()}
    assert validate_arguments(tool, {"code": "1", "sandbox": {}}).startswith(
        "python: unknown argument 'sandbox'")
    add, py = load_tools(f"{SAMPLE_TOOLS}:add,python")
    assert (add.name, py.name) == ("add", "python") and add.settings == {}


def test_a_tool_of_the_users_that_takes_sandbox_gets_the_runs(tmp_path) -> None:
    (tmp_path / "t.py").write_text(
        "from hybrid_engine.tools.sandbox import Sandbox\n\n"
        "def twice(code: str, sandbox: Sandbox) -> str:\n"
        '    """Runs code twice.\n\n    Args:\n        code: The program.\n'
        '        sandbox: The run\'s.\n    """\n'
        "    return sandbox.run(code).stdout * 2\n")
    mine = Sandbox(SandboxLimits(timeout_s=2.0))
    [tool] = load_tools(f"{tmp_path / 't.py'}:twice", settings={"sandbox": mine})
    assert tool.settings == {"sandbox": mine}
    assert list(tool.schema["function"]["parameters"]["properties"]) == ["code"]
    assert call_tool(tool, {"code": "print('hi')"}) == "hi\nhi\n"


@pytest.mark.parametrize("code, text", [
    ("print(6 * 7)", "42"),
    ("", "(no output)"),
    ("print('partial')\nraise ValueError('boom')", "partial\nstderr:\nTraceback"),
    ("import sys\nsys.exit(3)", "(exit code 3)"),
    ("import os\nos.kill(os.getpid(), 9)", "(killed by signal SIGKILL)"),
    ("print('x' * 3000)", "(stopped: its output passed 1 KiB; cut there)"),
    ("print('started', flush=True)\nwhile True:\n    pass", "started\n(stopped: it ran past 1 s)"),
])
def test_the_text_the_model_reads(code: str, text: str) -> None:
    [tool] = load_tools("python", settings={"sandbox": Sandbox(SandboxLimits(timeout_s=1.0,
                                                                             output_kb=1))})
    got = call_tool(tool, {"code": code})
    assert got.startswith(text) or got.endswith(text), got
    assert ("ValueError: boom" in got) == ("boom" in code)


FORK_8 = ("import os, time\nn = 0\nfor _ in range(8):\n    try:\n        pid = os.fork()\n"
          "    except OSError:\n        break\n    if pid == 0:\n        time.sleep(30)\n"
          "    n += 1\nprint(n)")


@pytest.mark.parametrize("key, value, code, stopped", [
    ("sandbox_memory_mb", 128, "b = bytearray(300 << 20)\nprint('allocated')",
     lambda r: "MemoryError" in r.stderr),
    ("sandbox_output_kb", 1, "print('x' * 5000)", lambda r: r.truncated),
    ("sandbox_processes", 4, FORK_8, lambda r: r.stdout.split() == ["3"]),
    ("sandbox_timeout_s", 1.0, "import time\ntime.sleep(2)\nprint('slept')",
     lambda r: r.timed_out and r.wall_s < 2.0),
])
def test_each_sandbox_key_reaches_the_run(key: str, value: float, code: str, stopped) -> None:
    """The key's value stops code; the default (checked but for the slow timeout) does not."""
    result = sandbox(EnvConfig(**{key: value})).run(code)
    assert stopped(result), result
    if key != "sandbox_timeout_s":
        default = sandbox(EnvConfig()).run(code)
        assert default.ok and not stopped(default), default


def test_a_python_tool_outlasts_its_sandbox_run() -> None:
    with pytest.raises(ValueError, match=r"env.tool_timeout_s=4 must be at least "
                                         r"env.sandbox_timeout_s \+ 2 = 5"):
        EnvConfig(name="tools", tools="python", sandbox_timeout_s=3.0, tool_timeout_s=4.0)
    EnvConfig(name="tools", tools="python", sandbox_timeout_s=3.0, tool_timeout_s=5.0)
    EnvConfig(name="tools", tools="python", sandbox_timeout_s=30.0, tool_timeout_s=0.0)


# --------------------------------------------------------------------------
# A sandbox service
# --------------------------------------------------------------------------


class _SandboxService(http.server.BaseHTTPRequestHandler):
    """SandboxFusion's POST /run_code, running the local sandbox; the code 'FAIL'
    gets the service's own error."""

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.requests.append((self.path, request))
        if request["code"] == "FAIL":
            reply = {"status": "SandboxError", "message": "no executor", "run_result": None}
        else:
            r = run_python(request["code"], stdin=request.get("stdin") or "",
                           limits=SandboxLimits(timeout_s=request["run_timeout"],
                                                memory_mb=request["memory_limit_MB"]))
            reply = {"status": "Success" if r.ok else "Failed", "message": "",
                     "run_result": {"status": "TimeLimitExceeded" if r.timed_out else "Finished",
                                    "execution_time": r.wall_s, "return_code": r.exit_code,
                                    "stdout": r.stdout, "stderr": r.stderr}}
        body = json.dumps(reply).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def service() -> Iterator[http.server.ThreadingHTTPServer]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _SandboxService)
    server.requests = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def test_with_a_url_the_code_runs_at_the_service(service) -> None:
    url = f"http://127.0.0.1:{service.server_port}/run_code"
    cfg = EnvConfig(name="tools", tools="python", sandbox_url=url, sandbox_timeout_s=1.0,
                    sandbox_memory_mb=256, sandbox_output_kb=1)
    [tool] = load_tools(cfg.tools, settings={"sandbox": sandbox(cfg)})
    got = sandbox(cfg).run("print(input()[::-1])", "olleh")
    assert (got.stdout, got.exit_code, got.isolation) == ("hello\n", 0, ("remote",))
    assert service.requests == [("/run_code", {
        "code": "print(input()[::-1])", "language": "python", "stdin": "olleh",
        "run_timeout": 1.0, "compile_timeout": 1.0, "memory_limit_MB": 256})]
    assert call_tool(tool, {"code": "print(6 * 7)"}) == "42"
    assert call_tool(tool, {"code": "while True:\n    pass"}) == "(stopped: it ran past 1 s)"
    assert call_tool(tool, {"code": "print('x' * 3000)"}).endswith("passed 1 KiB; cut there)")
    assert len(service.requests) == 4
    with pytest.raises(SandboxError, match="could not run the code: no executor"):
        call_tool(tool, {"code": "FAIL"})


def test_an_unreachable_service_is_a_sandbox_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends: connections are refused
    with pytest.raises(SandboxError, match=r"env.sandbox_url='http://127.0.0.1:\d+/run_code': "
                                           r"URLError"):
        Sandbox(url=f"http://127.0.0.1:{port}/run_code").run("print(1)")


# --------------------------------------------------------------------------
# In the tool workers
# --------------------------------------------------------------------------


def test_calls_that_raise_or_never_end_are_results_and_the_episode_goes_on() -> None:
    """Through ToolTask and its worker process: a sandbox that fails (the tool raises
    SandboxError) and an infinite loop are tool messages; the episode continues."""
    from hybrid_engine.envs.agent import ToolTask
    from hybrid_engine.envs.reward_pool import RewardPool

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    broken = Sandbox(SandboxLimits(timeout_s=1.0), url=f"http://127.0.0.1:{port}/run_code")
    [tool] = load_tools("python", settings={"sandbox": Sandbox(SandboxLimits(timeout_s=1.0))})
    [failing] = load_tools("python", settings={"sandbox": broken})
    pool = RewardPool(1, 3.0, preload=[tool.spec])
    try:
        for t, code, want in [(tool, "print(2 + 2)", "4"),
                              (tool, "while True:\n    pass", "(stopped: it ran past 1 s)"),
                              (failing, "print(1)", "error: SandboxError: env.sandbox_url=")]:
            task = ToolTask([t], pool)
            call = {"type": "function", "function": {"name": "python", "arguments": {"code": code}}}
            start = time.monotonic()
            messages, done, _ = task.step([{"role": "assistant", "content": "",
                                            "tool_calls": [call]}])
            assert not done and messages[0]["content"].startswith(want), messages
            assert time.monotonic() - start < 2.5
    finally:
        pool.close()
