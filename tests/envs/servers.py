"""A real HTTP server on localhost for the service reward terms' tests: a
scoring endpoint that records what it receives and fails on demand, and an
OpenAI-shaped chat-completions API with scripted replies."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class ScoringServer:
    """A scoring endpoint and a chat-completions API in one ThreadingHTTPServer.

    POST /ok: {"rewards": [len(completion), ...]}; /500, /bad-json, /short,
    /word: the failures; /slow: ok after 2 s. POST /v1/chat/completions:
    "Score: <the completion after 'Response:\\n'>" (none when it is "none").
    Every request is recorded (path, body), with the most in flight at once.
    """

    def __init__(self) -> None:
        self.requests: list[tuple[str, dict]] = []
        self.in_flight = self.most_in_flight = 0
        lock, server = threading.Lock(), self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # noqa: ANN002
                pass

            def _reply(self, code: int, body: bytes) -> None:
                try:
                    self.send_response(code)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up (its timeout)

            def do_GET(self) -> None:  # noqa: N802
                self._reply(200, json.dumps({"object": "list", "data": [
                    {"id": "listed-judge", "object": "model"}]}).encode())

            def do_POST(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with lock:
                    server.requests.append((self.path, body))
                    server.in_flight += 1
                    server.most_in_flight = max(server.most_in_flight, server.in_flight)
                try:
                    time.sleep(0.05)
                    self._answer(body)
                finally:
                    with lock:
                        server.in_flight -= 1

            def _answer(self, body: dict) -> None:
                if self.path.endswith("/chat/completions"):
                    text = body["messages"][0]["content"].split("Response:\n", 1)[-1]
                    reply = "I cannot tell" if text == "none" else f"Score: {text}"
                    self._reply(200, json.dumps({
                        "id": "x", "object": "chat.completion", "created": 0,
                        "model": body["model"], "choices": [{
                            "index": 0, "finish_reason": "stop",
                            "message": {"role": "assistant", "content": reply}}]}).encode())
                    return
                n = len(body["samples"])
                rewards = [float(len(s["completion"])) for s in body["samples"]]
                if self.path == "/slow":
                    time.sleep(2)
                out = {"/500": (500, b"oops"), "/bad-json": (200, b"{not json"),
                       "/short": (200, json.dumps({"rewards": rewards[:n - 1]}).encode()),
                       "/word": (200, json.dumps({"rewards": ["high"] * n}).encode())
                       }.get(self.path, (200, json.dumps({"rewards": rewards}).encode()))
                self._reply(*out)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_port}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def paths(self) -> list[str]:
        return [p for p, _ in self.requests]

    def samples(self) -> list[dict]:
        """Every sample the scoring endpoint received."""
        return [s for p, b in self.requests if "samples" in b for s in b["samples"]]

    def close(self) -> None:
        self.httpd.shutdown()
