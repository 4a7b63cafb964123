"""Compiling CuTe DSL kernels without a GPU: the toolchain check, the target architecture, fake tensors, artifacts.

CuTe DSL (pip package nvidia-cutlass-dsl) compiles in process: NVVM and ptxas need no driver and no device, and
`nvdisasm` (from the SASS extra of its libs package) turns the cubin into SASS. Two things must be right:
- CuTe DSL reads its architecture from CUTE_DSL_ARCH once, when cutlass is first imported (without it, it probes
  the driver and falls back to sm_100a), and kernels may consult it while they are traced. `environment(arch)`
  names that variable; `k3gate kernels build` sets it before anything imports cutlass (model code leaves the
  process environment alone), and every compile also passes the architecture explicitly;
- tensors are fake (shape, dtype, strides, alignment), so compiling needs neither torch nor device memory.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from harness.kernels_cmd import KernelArtifacts

INSTALL = "pip install 'k3gate[cutedsl]'"  # the extra pins nvidia-cutlass-dsl and its nvdisasm (SASS) package


class ToolchainError(RuntimeError):
    pass


def environment(arch: str) -> dict[str, str]:
    """What the compiling process's environment must hold before cutlass is imported."""
    return {"CUTE_DSL_ARCH": arch}


def missing() -> str | None:
    """Why CuTe DSL cannot compile with SASS here, naming the install line; None when it can."""
    try:
        importlib.import_module("cutlass.cute")
    except ImportError as exc:
        return f"CuTe DSL is not installed ({exc}) — {INSTALL}"
    env_manager = importlib.import_module("cutlass.base_dsl.env_manager")
    common = importlib.import_module("cutlass.base_dsl.common")
    find = getattr(env_manager, "_find_nvdisasm_binary", None)
    if find is None:  # 4.8.1's own probe; a release without it reports a missing nvdisasm when it compiles
        return None
    try:
        find()
    except common.DSLBaseError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return f"CuTe DSL cannot disassemble to SASS ({first}) — {INSTALL}"
    return None


@contextlib.contextmanager
def _stderr_to(path: Path) -> Iterator[None]:
    """Send file descriptor 2 to `path`: nvdisasm, run by the compiler, warns there on every call."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(path, "wb") as sink:
        os.dup2(sink.fileno(), 2)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def compile_artifacts(fn: Any, args: tuple[Any, ...], arch: str) -> KernelArtifacts:
    """`cute.compile(fn, *args)` for `arch`, keeping PTX, cubin and SASS."""
    import cutlass.cute as cute

    with tempfile.TemporaryDirectory(prefix="k3-cutedsl-") as tmp:
        dump = Path(tmp) / "dump"
        dump.mkdir()  # CuTe writes nothing, silently, into a folder that does not exist
        options = f"--gpu-arch {arch} --keep-ptx --keep-cubin --keep-sass --dump-dir {dump}"
        with _stderr_to(Path(tmp) / "stderr.txt"):
            compiled = cute.compile(fn, *args, options=options)
        ptx, cubin, sass = compiled.__ptx__, compiled.__cubin__, compiled.__sass__
    if not isinstance(ptx, str) or not isinstance(cubin, bytes) or not isinstance(sass, str):
        raise ToolchainError("CuTe DSL returned no PTX, cubin or SASS for the compile — check the dump options")
    if "\n" not in sass:  # the dump's path, not its text: nothing was disassembled, and SASS checks would pass empty
        raise ToolchainError(
            f"CuTe DSL wrote no SASS for {arch}: it disassembles only for the arch CUTE_DSL_ARCH names when cutlass is "
            f"first imported (here {os.environ.get('CUTE_DSL_ARCH')!r}) — set CUTE_DSL_ARCH={arch} before importing it"
        )
    return KernelArtifacts(ptx=ptx, cubin=cubin, sass=sass)


def fake_tensor(dtype: Any, shape: tuple[Any, ...]) -> Any:
    """A fake row-major tensor, 16-byte aligned (every kernel here moves 16-byte vectors)."""
    from cutlass.cute.runtime import make_fake_compact_tensor

    order = tuple(range(len(shape)))[::-1]
    return make_fake_compact_tensor(dtype, shape, stride_order=order, assumed_align=16)


def fake_stream() -> Any:
    from cutlass.cute.runtime import make_fake_stream

    return make_fake_stream()
