"""The server runner's life cycle against a stand-in process: start-up crash, hang, Ctrl-C, stop by group."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from harness.runners.server import ServerError, ServerSpec, VllmServer, log_tail

REPO = Path(__file__).resolve().parents[3]


def spec(mode: str, timeout: float = 60.0, **env: str) -> ServerSpec:
    return ServerSpec(
        python=sys.executable,
        model="m",
        served_model_name="tiny",
        decode_backend="latency_specialized",
        max_model_len=2048,
        module="tests.harness.vllm.fake_server",
        env=tuple(sorted({"FAKE_SERVER_MODE": mode, "PYTHONPATH": str(REPO), **env}.items())),
        startup_timeout_s=timeout,
    )


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it has exited all the same.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def wait_gone(pid: int, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not alive(pid):
            return True
        time.sleep(0.1)
    return False


def test_argv_carries_the_arm_and_the_deployment():
    s = ServerSpec(
        python="py",
        model="/models/k3",
        served_model_name="kimi-k3",
        decode_backend="latency_specialized",
        max_model_len=262144,
        tensor_parallel_size=8,
        cudagraph_mode="FULL_DECODE_ONLY",
        logits_processors=("harness.vllm_plugin.forcing:ForcedTokens",),
        extra_args=("--kv-cache-dtype", "fp8"),
    )
    argv = s.argv(8123)
    assert argv[:3] == ["py", "-m", "vllm.entrypoints.openai.api_server"]
    assert json.loads(argv[argv.index("--additional-config") + 1]) == {"decode_backend": "latency_specialized"}
    assert argv[argv.index("--tensor-parallel-size") + 1] == "8"
    assert json.loads(argv[argv.index("--compilation-config") + 1]) == {"cudagraph_mode": "FULL_DECODE_ONLY"}
    assert "--enforce-eager" not in argv and argv[-2:] == ["--kv-cache-dtype", "fp8"]
    assert argv[argv.index("--logits-processors") + 1] == "harness.vllm_plugin.forcing:ForcedTokens"


def test_crash_during_start_up_is_one_line_with_the_log_tail(tmp_path):
    server = VllmServer(spec("crash"), tmp_path / "server.log", "candidate")
    with pytest.raises(ServerError) as err, server:
        pass
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("candidate server exited with code 1 during start-up")
    assert "does not support TP other than 8/16" in msg and server.proc is None


def test_hung_server_times_out_and_its_whole_group_is_stopped(tmp_path):
    pid_file = tmp_path / "child.pid"
    server = VllmServer(spec("hang", timeout=3, FAKE_SERVER_CHILD_PID=str(pid_file)), tmp_path / "s.log", "baseline")
    start = time.monotonic()
    with pytest.raises(ServerError, match=r"baseline server did not become healthy within 3 s \(hung"), server:
        pass
    assert time.monotonic() - start < 30
    assert wait_gone(int(pid_file.read_text())), "the server's child outlived the stop"


def test_ctrl_c_stops_a_healthy_server_and_its_children(tmp_path):
    pid_file = tmp_path / "child.pid"
    server = VllmServer(spec("healthy", FAKE_SERVER_CHILD_PID=str(pid_file)), tmp_path / "s.log", "candidate")
    with pytest.raises(KeyboardInterrupt), server:
        assert server.startup_s is not None
        leader = server.proc.pid
        raise KeyboardInterrupt
    assert wait_gone(leader) and wait_gone(int(pid_file.read_text()))


def test_a_server_that_dies_later_is_reported_as_crashed(tmp_path):
    server = VllmServer(spec("healthy"), tmp_path / "s.log", "candidate")
    with server:
        os.killpg(server.proc.pid, 9)
        server.proc.wait()
        with pytest.raises(ServerError, match=r"candidate server crashed .* during lm-eval"):
            server.ensure_alive("lm-eval")


def test_log_tail_prefers_the_error_line(tmp_path):
    log = tmp_path / "x.log"
    log.write_text(
        "\n".join(["INFO start", "ERROR boom: RuntimeError: bad thing", *[f"INFO line {i}" for i in range(20)]])
    )
    tail = log_tail(log, lines=2)
    assert tail.startswith("ERROR boom: RuntimeError: bad thing") and "INFO line 19" in tail and "\n" not in tail


def test_out_of_scope_deployment_must_be_refused_with_the_models_error(tmp_path):
    from harness.runners import out_of_scope

    case = {"name": "tp4", "extra_args": ["--tensor-parallel-size", "4"], "expect_error": "TP other than 8/16"}
    check, why = out_of_scope.judge(spec("crash"), case, tmp_path / "a.log", tmp_path / "p")
    assert why is None and check.passed
    other = {**case, "expect_error": "does not support expert parallelism"}  # it died, but not of its scope check
    check, _ = out_of_scope.judge(spec("crash"), other, tmp_path / "b.log", tmp_path / "p")
    assert not check.passed
    check, _ = out_of_scope.judge(spec("healthy"), case, tmp_path / "c.log", tmp_path / "p")
    assert not check.passed and "started" in check.detail  # it started and could not serve: no proof either way
