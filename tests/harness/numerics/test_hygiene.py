from __future__ import annotations

import pytest
import torch

from harness.numerics import redteam_kernels as rt
from harness.numerics.hygiene import run_cell
from tests.harness.numerics.toy_op import TABLE, ToyCase, correct, reference

CPU = torch.device("cpu")
FORBIDDEN = (reference.__code__,)


def failed(result) -> list[str]:
    return [c.name for c in result.checks if not c.passed]


@pytest.mark.parametrize("batch", [1, 4, 7])
def test_correct_kernel_passes_every_check(batch):
    result = run_cell(ToyCase(batch), correct, CPU, TABLE, FORBIDDEN)
    assert result.passed, failed(result)
    assert len(result.checks) > 20


def test_zero_output_fails_the_nontrivial_and_match_checks():
    names = failed(run_cell(ToyCase(4), rt.returns_zeros(correct), CPU, TABLE, FORBIDDEN))
    assert any("matched fraction" in n for n in names)


def test_calling_the_oracle_is_caught():
    impl = rt.calls_the_oracle(reference, torch.bfloat16, inplace=("state",))
    names = failed(run_cell(ToyCase(4), impl, CPU, TABLE, FORBIDDEN))
    assert names == ["oracle entry points called by the implementation"]


def test_caching_by_address_is_caught():
    names = failed(run_cell(ToyCase(4), rt.caches_by_address(correct), CPU, TABLE, FORBIDDEN))
    assert any(n.startswith("fresh values in reused buffers") for n in names)


def test_grid_shaped_kernel_fails_off_the_grid():
    impl = rt.grid_shapes_only(correct, batches=[1, 2, 4, 8], batch_input="x")
    assert run_cell(ToyCase(4), impl, CPU, TABLE, FORBIDDEN).passed
    assert not run_cell(ToyCase(5), impl, CPU, TABLE, FORBIDDEN).passed


def test_skipping_part_of_the_batch_is_caught():
    assert not run_cell(ToyCase(4), rt.skips_part_of_the_batch(correct, "x"), CPU, TABLE, FORBIDDEN).passed


def test_mutating_an_input_is_caught():
    names = failed(run_cell(ToyCase(4), rt.mutates_an_input(correct, "w"), CPU, TABLE, FORBIDDEN))
    assert "w: input unchanged" in names


def test_stale_state_reads_are_caught_by_chained_steps():
    names = failed(run_cell(ToyCase(4), rt.reads_stale_state(correct, "state"), CPU, TABLE, FORBIDDEN))
    assert any(n.startswith("step 2: ") for n in names)
    assert not any(n.startswith("y:") for n in names)  # the first call alone looks right


def test_writes_outside_the_write_set_are_caught():
    def writes_a_neighbour(call):
        out = correct(call)
        call.tensors["state"][2] += 1.0  # slot 2 belongs to no request of this batch
        return out

    names = failed(run_cell(ToyCase(4), writes_a_neighbour, CPU, TABLE, FORBIDDEN))
    assert "state: writes outside the declared write set" in names


def test_out_of_bounds_writes_hit_the_guard_band():
    def overruns(call):
        out = correct(call)
        x = call.tensors["x"]
        if x.untyped_storage().nbytes() >= (x.storage_offset() + x.numel() + 4) * x.element_size():
            torch.as_strided(x, (x.numel() + 4,), (1,), x.storage_offset())[-4:].fill_(1.0)  # past the end of x
        return out

    names = failed(run_cell(ToyCase(4), overruns, CPU, TABLE, FORBIDDEN))
    assert "x: guard bands intact (no out-of-bounds writes)" in names


def test_nondeterminism_is_caught():
    calls = {"n": 0}

    def flaky(call):
        calls["n"] += 1
        out = correct(call)
        if calls["n"] == 2:
            out["y"][0, 0] += 0.0078125
        return out

    assert "bit-identical rerun" in failed(run_cell(ToyCase(4), flaky, CPU, TABLE, FORBIDDEN))


@pytest.mark.gpu
def test_side_stream_without_sync_is_caught_on_gpu():
    cuda = torch.device("cuda")
    assert run_cell(ToyCase(4), correct, cuda, TABLE, FORBIDDEN).passed
    assert not run_cell(ToyCase(4), rt.side_stream_without_sync(correct), cuda, TABLE, FORBIDDEN).passed
