"""How many clusters of a launch the GPU holds at once, from the driver's occupancy calculator.

The fused o_proj's epilogue clusters wait for the whole grid, so a launch finishes only if the device holds more of
its clusters at once than wait (kda_o_proj.py, "Deadlock freedom"). SMs x CTAs an SM / cluster size overstates
that: a cluster's CTAs share one GPC, and the slots a GPC has left over after its last whole cluster hold none. On
one H100 at b8e3e11 the wgmma build sized for two CTAs an SM (101888 bytes each, clusters of 7) finished with 24
epilogue clusters waiting and hung with 32, where that count gives 132 x 2 // 7 = 37. The driver's calculator
(cuOccupancyMaxActiveClusters) knows the GPCs.

It is asked about an empty kernel (PTX the driver compiles) with the launch's cluster size and threads and a
dynamic shared-memory request padded so that no SM holds more than `ctas_per_sm` of it: the build's registers are
capped for at least that many (ptxas's minnctapersm, checked in CI) and its own shared memory fits that many, so the
real kernel holds at least as many clusters as the answer: a lower bound, the direction a deadlock argument needs.
It is an idle GPU's count: beside a running kernel (programmatic dependent launch) fewer may fit, so passing it is
necessary, not sufficient, and the plans keep a margin of their own (kda_o_proj_plan.WAITING_SHARE).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Any

_PROBE_ENTRY = "k3_cluster_residency_probe"
_PROBE_PTX = f""".version 8.0
.target sm_90
.address_size 64
.visible .entry {_PROBE_ENTRY}()
{{
    ret;
}}
"""


def _value(result: tuple, call: str) -> Any:
    import cuda.bindings.driver as cuda

    err, *value = result
    if err != cuda.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cluster residency: {call} failed with {err.name}; is the CUDA driver 12.0 or newer?")
    return value[0] if value else None


def padded_request(smem_bytes: int, ctas_per_sm: int, sm_bytes: int, reserved_per_cta: int) -> int:
    """A dynamic shared-memory request of at least `smem_bytes` that an SM of `sm_bytes` (with the driver's
    `reserved_per_cta` beside each CTA) holds at most `ctas_per_sm` times."""
    if ctas_per_sm < 1 or smem_bytes < 0:
        raise ValueError(f"cluster residency: ctas_per_sm {ctas_per_sm} and smem_bytes {smem_bytes} must be >= 1, >= 0")
    least = sm_bytes // (ctas_per_sm + 1) - reserved_per_cta + 1  # ctas_per_sm + 1 of these overflow the SM
    return max(smem_bytes, least)


@cache
def max_active_clusters(device_index: int, cluster: int, threads: int, ctas_per_sm: int, smem_bytes: int) -> int:
    """Clusters of `cluster` CTAs of `threads` threads, each asking for `smem_bytes` of dynamic shared memory and at
    most `ctas_per_sm` an SM, that CUDA device `device_index` holds at once (a lower bound for a kernel whose
    registers and shared memory fit `ctas_per_sm` an SM; see the module's docstring)."""
    import cuda.bindings.driver as cuda

    dev = _value(cuda.cuDeviceGet(device_index), "cuDeviceGet")
    attr = cuda.CUdevice_attribute
    sm_bytes = _value(
        cuda.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR, dev),
        "cuDeviceGetAttribute",
    )
    reserved = _value(
        cuda.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_RESERVED_SHARED_MEMORY_PER_BLOCK, dev),
        "cuDeviceGetAttribute",
    )
    request = padded_request(smem_bytes, ctas_per_sm, sm_bytes, reserved)
    # The primary context (torch's), made current here and undone here; the calls below do no stream work. The op
    # asks once per shape, at its first, eager launch of that shape, which compiles the kernel too, so never while a
    # CUDA graph is being captured.
    context = _value(cuda.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
    undo: list[tuple[str, Callable[[], tuple]]] = [
        ("cuDevicePrimaryCtxRelease", lambda: cuda.cuDevicePrimaryCtxRelease(dev))
    ]
    try:
        _value(cuda.cuCtxPushCurrent(context), "cuCtxPushCurrent")
        undo.append(("cuCtxPopCurrent", cuda.cuCtxPopCurrent))
        module = _value(cuda.cuModuleLoadData(_PROBE_PTX.encode() + b"\0"), "cuModuleLoadData")
        undo.append(("cuModuleUnload", lambda: cuda.cuModuleUnload(module)))
        count = _clusters_at_once(module, cluster, threads, request)
    except BaseException:
        for _, call in reversed(undo):
            call()  # every step undone; the error in flight is the one to report
        raise
    _undo_all(undo)
    return count


def _undo_all(undo: list[tuple[str, Callable[[], tuple]]]) -> None:
    """Every cleanup call, last first, all of them even if one fails; then the first failure, if any."""
    failures = []
    for name, call in reversed(undo):
        try:
            _value(call(), name)
        except RuntimeError as exc:
            failures.append(exc)
    if failures:
        raise failures[0]


def _clusters_at_once(module: Any, cluster: int, threads: int, request: int) -> int:
    import cuda.bindings.driver as cuda

    fn = _value(cuda.cuModuleGetFunction(module, _PROBE_ENTRY.encode()), "cuModuleGetFunction")
    fattr = cuda.CUfunction_attribute
    _value(
        cuda.cuFuncSetAttribute(fn, fattr.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, request),
        "cuFuncSetAttribute",
    )
    _value(
        cuda.cuFuncSetAttribute(fn, fattr.CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1), "cuFuncSetAttribute"
    )
    config = cuda.CUlaunchConfig()
    config.gridDimX, config.gridDimY, config.gridDimZ = cluster, 1, 1
    config.blockDimX, config.blockDimY, config.blockDimZ = threads, 1, 1
    config.sharedMemBytes = request
    value = cuda.CUlaunchAttributeValue()
    value.clusterDim.x, value.clusterDim.y, value.clusterDim.z = cluster, 1, 1
    dims = cuda.CUlaunchAttribute()
    dims.id = cuda.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
    dims.value = value
    config.attrs, config.numAttrs = [dims], 1
    return int(_value(cuda.cuOccupancyMaxActiveClusters(fn, config), "cuOccupancyMaxActiveClusters"))
