"""A local OpenAI-compatible chat endpoint for tests: dspy.LM talks to it over HTTP as it would
to vLLM or Ollama, and it answers in DSPy's chat format with a label chosen by `label_of`."""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable


def text_of(prompt: str) -> str:
    """The text field of DSPy's chat prompt (the last user message)."""
    return prompt.split("[[ ## text ## ]]")[-1].split("Respond with")[0].strip()


class FakeChatServer:
    """`with FakeChatServer(label_of) as server:` serves at server.api_base; server.calls counts
    the completions asked for. status != 200 makes every call fail with that HTTP status;
    fail_first=N fails only the first N calls (503), as an overloaded server does."""

    def __init__(self, label_of: Callable[[str], str], status: int = 200,
                 fail_first: int = 0) -> None:
        self.label_of, self.status, self.calls = label_of, status, 0
        self.fail_first = fail_first  # answer this many calls with HTTP 503 first
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.calls += 1
                if server.status != 200 or server.calls <= server.fail_first:
                    self.send_response(503 if server.status == 200 else server.status)
                    self.end_headers()
                    return
                label = server.label_of(text_of(body["messages"][-1]["content"]))
                content = f"[[ ## label ## ]]\n{label}\n\n[[ ## completed ## ]]"
                data = json.dumps({
                    "id": "test", "object": "chat.completion", "created": 0,
                    "model": body.get("model"),
                    "choices": [{"index": 0, "finish_reason": "stop",
                                 "message": {"role": "assistant", "content": content}}],
                    "usage": {"prompt_tokens": 1, "completion_tokens": 1,
                              "total_tokens": 2}}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.api_base = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def __enter__(self) -> "FakeChatServer":
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
