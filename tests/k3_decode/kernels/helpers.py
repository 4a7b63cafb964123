"""What the kernel build tests share: where the repo is, whether CuTe DSL is here, the driverless launch probe, and
sm_90a PTX compiled once per build for the same-values checks."""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[3]
BUILDS = "k3_decode.kernels.builds:K3_KERNEL_BUILDS"
HAS_CUTEDSL = importlib.util.find_spec("cutlass") is not None
needs_cutedsl = pytest.mark.skipif(not HAS_CUTEDSL, reason="CuTe DSL is not installed: pip install 'k3gate[cutedsl]'")


@functools.cache
def sm90_ptx(build: Any) -> str:
    """A build's sm_90a PTX, compiled once a test session: several variants compare against one plain twin. Not for
    a build compiled under a patch (compile that one directly)."""
    return build.compile("sm_90a").ptx


def assert_launch_reaches_the_driver(script: str, tmp_path: Path) -> None:
    """Run `script` (set-up on CPU tensors whose last line is one launcher call) in a fresh process: the launch must
    fail for want of a driver (CUDA error 35), not at binding an argument. The last line runs under a catch that
    reports what it raised. Skips where a GPU would really run."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("CPU tensors must not reach a real launch; the GPU tests cover this machine")
    setup, _, launch = script.strip().rpartition("\n")
    caught = (
        f"{setup}\ntry:\n    {launch}\nexcept Exception as exc:\n"
        '    print("RAISED", type(exc).__name__, "cudaErrorInsufficientDriver" in str(exc))\n'
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "CUTE_DSL_ARCH": "sm_90a"}
    proc = subprocess.run(
        [sys.executable, "-c", caught], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "RAISED DSLCudaRuntimeError True" in proc.stdout, proc.stdout + proc.stderr[-3000:]


def build_command(tmp_path: Path, *args: str, prelude: str = "") -> subprocess.CompletedProcess[str]:
    """`k3gate kernels build --arch sm_90a --builds ...` in a fresh process (CuTe DSL reads its arch on import);
    `prelude` runs first (e.g. to hide a module)."""
    argv = ["build", "--arch", "sm_90a", "--builds", BUILDS, *args]
    code = f"{prelude}\nimport sys\nfrom harness.kernels_cmd import main\nsys.exit(main({argv!r}))\n"
    env = {**os.environ, "PYTHONPATH": str(REPO), "XDG_CONFIG_HOME": str(tmp_path / "xdg")}
    env.pop("CUTE_DSL_ARCH", None)  # the command must set it itself
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=1200
    )


def failed_checks_of_broken_build(tmp_path: Path, match: str, patch: str) -> set[str]:
    """The checks that fail when the one build `match` is compiled with `patch` (a module's source, imported in the
    compiling process only: CuTe DSL reads a jit function's source from its file) applied first. The build command
    must fail, and the build must still compile and meet its register cap: the rules are what catch it."""
    (tmp_path / "broken_patch.py").write_text(patch)
    prelude = f"import sys\nsys.path.insert(0, {str(tmp_path)!r})\nimport broken_patch"
    out = tmp_path / "out"
    proc = build_command(tmp_path, "--out", str(out), "--match", match, prelude=prelude)
    assert proc.returncode == 1, proc.stderr
    (result,) = json.loads((out / "report.json").read_text())["builds"]
    failed = {c["name"] for c in result["checks"] if not c["passed"]}
    assert "compiles" not in failed and "registers" not in failed, sorted(failed)
    return failed


def compiled_cubin(kernel: Any, args: tuple[Any, ...]) -> tuple[bytes, str]:
    """The cubin of `kernel` compiled for sm_90a from `args` as its op compiles it, and its entry's name (no SASS:
    the GPU machine has no nvdisasm)."""
    import cutlass.cute as cute

    with tempfile.TemporaryDirectory(prefix="k3-cubin-") as tmp:
        options = f"--gpu-arch sm_90a --keep-ptx --keep-cubin --dump-dir {tmp}"
        compiled = cute.compile(kernel, *args, options=options)
        ptx, cubin = compiled.__ptx__, compiled.__cubin__
    entry = re.search(r"\.entry\s+(\w+)\s*\(", ptx)
    assert isinstance(cubin, bytes) and entry, "CuTe DSL returned no cubin or no kernel entry"
    return cubin, entry.group(1)


def driver_value(result: tuple) -> Any:
    """The value of a cuda.bindings driver call, or a failure naming its error code."""
    import cuda.bindings.driver as cuda

    err, *value = result
    assert err == cuda.CUresult.CUDA_SUCCESS, f"CUDA driver call failed: {err}"
    return value[0] if value else None


def ctas_per_sm(cubin: bytes, entry: str, threads: int, smem_requests: list[int]) -> list[int]:
    """What the driver's occupancy calculator fits on an SM of this GPU at each dynamic shared-memory request."""
    import cuda.bindings.driver as cuda
    import torch

    torch.zeros(1, device="cuda")  # the primary context, current on this thread
    module = driver_value(cuda.cuModuleLoadData(cubin))
    try:
        fn = driver_value(cuda.cuModuleGetFunction(module, entry.encode()))
        attr = cuda.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        driver_value(cuda.cuFuncSetAttribute(fn, attr, max(smem_requests)))
        return [driver_value(cuda.cuOccupancyMaxActiveBlocksPerMultiprocessor(fn, threads, n)) for n in smem_requests]
    finally:
        driver_value(cuda.cuModuleUnload(module))
