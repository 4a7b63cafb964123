"""An in-process stand-in for a vLLM OpenAI server and its k3gate plugin, for the serving perf tests.

It streams completions token by token (`token_s` apart, continuous usage stats), tokenizes by words, and writes a
proof-of-path snapshot the way the plugin does: one decode step per streamed token after the first, on `path`.
Knobs for red-team arms: `short` (stop that many tokens early), `path` ("specialized" or "stock"), `probe` (None:
no path probe for this model), `tokens_per_chunk`.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from harness.runners import arms
from harness.runners.client import OpenAIClient
from harness.runners.server import ServerSpec
from harness.runners.session import RunningArm


@dataclass
class FakeModel:
    token_s: float = 0.002
    short: int = 0
    path: str = "specialized"
    probe: str | None = "fake probe"
    tokens_per_chunk: int = 1
    decode_backend: str = "auto"
    path_dir: Path | None = None
    steps: int = 0
    decode_steps: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            return {
                "written_at": time.time(),
                "architecture": "FakeForCausalLM",
                "additional_config": {"decode_backend": self.decode_backend},
                "probe": self.probe,
                "probe_note": "" if self.probe else "no path probe for FakeForCausalLM",
                "steps": self.steps,
                "by_shape": {"decode": self.decode_steps},
                "by_path": {f"decode:{self.path}": self.decode_steps} if self.probe else {},
                "fallback_reasons": {"decode: fake fallback": self.decode_steps} if self.path == "stock" else {},
            }

    def write(self) -> None:
        """Rewrite the snapshot atomically (request threads and the refresher all write it)."""
        if self.path_dir is None:
            return
        snap = json.dumps(self.snapshot())
        with self.lock:
            self.path_dir.mkdir(parents=True, exist_ok=True)
            tmp = self.path_dir / f"path-1.json.{threading.get_ident()}"
            tmp.write_text(snap)
            tmp.replace(self.path_dir / "path-1.json")


def _handler(model: FakeModel) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def _json(self, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path == "/tokenize":
                words = body["prompt"].split()
                self._json({"tokens": [sum(map(ord, w)) % 500 for w in words]})
                return
            if self.path != "/v1/completions":
                self.send_response(404)
                self.end_headers()
                return
            want = max(1, body["max_tokens"] - model.short)
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            sent = 0
            while sent < want:
                n = min(model.tokens_per_chunk, want - sent)
                time.sleep(model.token_s * n)
                sent += n
                with model.lock:
                    model.steps += n
                    model.decode_steps += n if sent > n else n - 1
                finish = "length" if sent == want else None
                chunk = {"choices": [{"text": "x" * n, "finish_reason": finish}], "usage": {"completion_tokens": sent}}
                self._event(chunk)
            self._event("[DONE]")
            self.wfile.write(b"0\r\n\r\n")
            model.write()

        def _event(self, payload: Any) -> None:
            text = payload if isinstance(payload, str) else json.dumps(payload)
            data = f"data: {text}\n\n".encode()
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()

    return Handler


@dataclass
class _FakeServer:
    startup_s: float = 0.0

    def ensure_alive(self, during: str) -> None:
        return None


def _keep_writing(model: FakeModel, stop: threading.Event) -> None:
    while not stop.wait(0.05):
        model.write()  # the plugin rewrites its snapshot every 0.1 s


@contextlib.contextmanager
def serve(models: dict[str, FakeModel], root: Path) -> Iterator[dict[str, RunningArm]]:
    """Running arms backed by fake servers, one per model name."""
    servers, threads, stop = [], [], threading.Event()
    running: dict[str, RunningArm] = {}
    try:
        for name, model in models.items():
            model.path_dir = root / f"path-{name}"
            model.write()
            httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(model))
            servers.append(httpd)
            for target in (httpd.serve_forever, lambda m=model: _keep_writing(m, stop)):
                t = threading.Thread(target=target, daemon=True)
                t.start()
                threads.append(t)
            url = f"http://127.0.0.1:{httpd.server_address[1]}"
            spec = ServerSpec("python", "fake", "fake", model.decode_backend, 1024)
            client = OpenAIClient(url, "fake", 30.0)
            running[name] = RunningArm(name, spec, _FakeServer(), client, model.path_dir)  # type: ignore[arg-type]
        yield running
    finally:
        stop.set()
        for httpd in servers:
            httpd.shutdown()
            httpd.server_close()


def provider(models: dict[str, FakeModel], root: Path) -> Any:
    """An ArmProvider over fake servers (both arms at once or one at a time, as the stage asks)."""

    @contextlib.contextmanager
    def provide(names: tuple[str, ...], dep: arms.Deployment) -> Iterator[dict[str, RunningArm]]:
        with serve({n: models[n] for n in names}, root) as running:
            yield running

    return provide
