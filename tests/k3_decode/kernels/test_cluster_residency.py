"""cluster_residency.padded_request (no GPU): the shared-memory request the driver is asked about holds no more
CTAs an SM than the build's registers are capped for, and never less than the build asks for."""

from __future__ import annotations

import pytest

from k3_decode.kernels.cluster_residency import padded_request

H100_SM, RESERVED = 233472, 1024  # an H100/H200 SM's shared memory and the driver's share beside each CTA


@pytest.mark.parametrize("per_sm", [1, 2, 3, 4, 8])
def test_the_padded_request_fits_exactly_the_ctas_asked(per_sm: int):
    request = padded_request(1024, per_sm, H100_SM, RESERVED)
    assert per_sm * (request + RESERVED) <= H100_SM < (per_sm + 1) * (request + RESERVED)


def test_a_larger_request_is_kept():
    """A build whose own shared memory allows fewer CTAs than asked keeps its request: the driver then counts what
    the shared memory allows (the wgmma build at two an SM asks 101888 bytes: two fit, three do not)."""
    assert padded_request(101888, 2, H100_SM, RESERVED) == 101888
    assert padded_request(150000, 3, H100_SM, RESERVED) == 150000


@pytest.mark.parametrize(("smem", "per_sm"), [(-1, 2), (0, 0)])
def test_nonsense_is_refused(smem: int, per_sm: int):
    with pytest.raises(ValueError, match="cluster residency"):
        padded_request(smem, per_sm, H100_SM, RESERVED)


class FakeDriver:
    """The driver calls max_active_clusters makes, recorded; `fail` names one that returns an error."""

    def __init__(self, cuda, fail: str = "", clusters: int = 32) -> None:
        self.cuda, self.fail, self.clusters, self.calls = cuda, fail, clusters, []

    def install(self, monkeypatch) -> None:
        ok = self.cuda.CUresult.CUDA_SUCCESS
        values = {
            "cuDeviceGet": 0,
            "cuDevicePrimaryCtxRetain": "ctx",
            "cuModuleLoadData": "module",
            "cuModuleGetFunction": "fn",
            "cuOccupancyMaxActiveClusters": self.clusters,
        }
        for name in (
            *values,
            "cuDeviceGetAttribute",
            "cuCtxPushCurrent",
            "cuFuncSetAttribute",
            "cuModuleUnload",
            "cuCtxPopCurrent",
            "cuDevicePrimaryCtxRelease",
        ):

            def call(*args, name=name):
                self.calls.append(name)
                if name == self.fail:
                    return (self.cuda.CUresult.CUDA_ERROR_INVALID_VALUE,)
                if name == "cuDeviceGetAttribute":
                    return ok, H100_SM if "MULTIPROCESSOR" in args[0].name else RESERVED
                return (ok, values[name]) if name in values else (ok,)

            monkeypatch.setattr(self.cuda, name, call)


def test_the_driver_is_asked_inside_a_context_it_undoes_whatever_fails(monkeypatch):
    """Every acquisition (the primary context, its push, the probe module) is undone, last first, on success and when
    a call fails; a failure is one error naming the call. Broken case: the occupancy call failing."""
    cuda = pytest.importorskip("cuda.bindings.driver")
    from k3_decode.kernels import cluster_residency

    undone = ["cuModuleUnload", "cuCtxPopCurrent", "cuDevicePrimaryCtxRelease"]
    fake = FakeDriver(cuda)
    fake.install(monkeypatch)
    assert cluster_residency.max_active_clusters.__wrapped__(0, 7, 128, 2, 101888) == 32
    assert fake.calls[-4:] == ["cuOccupancyMaxActiveClusters", *undone]
    assert fake.calls.index("cuCtxPushCurrent") < fake.calls.index("cuModuleLoadData")
    broken = FakeDriver(cuda, fail="cuOccupancyMaxActiveClusters")
    broken.install(monkeypatch)
    with pytest.raises(RuntimeError, match=r"cuOccupancyMaxActiveClusters failed with CUDA_ERROR_INVALID_VALUE"):
        cluster_residency.max_active_clusters.__wrapped__(0, 7, 128, 2, 101888)
    assert broken.calls[-3:] == undone
    early = FakeDriver(cuda, fail="cuCtxPushCurrent")  # nothing but the retained context to undo
    early.install(monkeypatch)
    with pytest.raises(RuntimeError, match="cuCtxPushCurrent"):
        cluster_residency.max_active_clusters.__wrapped__(0, 7, 128, 2, 101888)
    assert early.calls[-2:] == ["cuCtxPushCurrent", "cuDevicePrimaryCtxRelease"]
