"""GPU: the runtime isolation suite at real K3 per-rank shapes (the h200 config: TP8 and TP16), with CUDA-graph
captures and replays under the on-device audit, and kernel names from torch.profiler joined with the graph's records.
"""

from __future__ import annotations

import time

import pytest
import torch

from harness.config.loader import load_config
from k3_decode.executor import StackExecutor, load_stack
from k3_decode.executor.audit import audit_capture, audit_step
from k3_decode.isolation_suite import K3IsolationSuite
from k3_decode.runtime.ledger import Ledger
from k3_decode.runtime.writeset import kda_state_name
from tests.k3_decode.executor.helpers import decode_requests, prefill

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def real():
    started = time.perf_counter()
    evidence = K3IsolationSuite.from_config("k3-hopper", load_config("h200")).run(lambda what, done: None)
    print(f"runtime isolation suite at h200 shapes: {time.perf_counter() - started:.1f} s")
    return evidence


def test_every_check_at_real_shapes_passes(real):
    failed = [f"{c.name}: {c.detail}" for c in real.checks if not c.passed]
    assert not failed, failed
    for c in real.checks:
        print(f"PASS {c.name} | {c.detail[:160]}")
    for n in real.not_run:
        print(f"NOT RUN {n.name} | {n.reason}")


def test_graph_cells_ran_under_the_audit_and_the_profiler(real):
    runs = [f"tp{tp} {backend}" for tp in (8, 16) for backend in ("auto", "latency_specialized")]
    names = [c.name for c in real.checks]
    for run in runs:
        assert any(n.startswith(f"{run} graph-decode capture of graph B4q1") for n in names), names
        assert sum(n.startswith(f"{run} graph-decode replay of graph B4q1 at step") for n in names) == 2
        profiled = [c for c in real.checks if c.name.startswith(f"{run} graph-decode: the kernels graph B4q1")]
        assert len(profiled) == 1 and "kernel launches seen" in profiled[0].detail
    # Each run also has its speculative twin (verify cells only, no graphs): the runner's verify steps, which on the
    # latency_specialized runs reach the KDA step kernel's verify body.
    assert {r.name for r in real.runs} == set(runs) | {f"{run} q4" for run in runs}
    replays = {r.name: r.ledger["replays"] for r in real.runs}
    assert replays == {run: {"B4q1": 2} for run in runs} | {f"{run} q4": {} for run in runs}
    # The CuTe DSL kernels' device-side counters agree with every run's ledger: the launches the specialized runs
    # claim, and none in the stock runs.
    for run in runs + [f"{run} q4" for run in runs]:
        assert f"{run}: device-side execution counters match the launches the ledger claims" in names
    assert [f"{n.name}: {n.reason}" for n in real.not_run] == []


def test_kernel_names_the_profiler_did_not_see_fail_the_join(real):
    """Broken case of the profiler join: the same graph records against an empty profile."""
    run = next(r for r in real.runs if r.name == "tp8 auto")
    window = Ledger()
    window.record(*[r for r in Ledger.from_json(run.ledger).records() if r.graph == "B4q1"])
    window.replayed("B4q1", 2)
    window.report_profiler_kernels({})
    ex = StackExecutor.start(load_stack("k3-mini-kda3-mla", 1), device="cuda", log=lambda line: None)
    mismatches = window.check_execution(ex.kernel_catalog())
    assert mismatches and all("the profiler saw no kernel named like it" in m for m in mismatches), mismatches


def test_a_kda_decode_that_writes_the_null_slot_is_caught_at_capture_and_in_replays():
    """Broken case of the on-device audit: a KDA decode that also writes the NULL slot (the one padding rows point
    at, which no kernel may write) is named at the capture (its eager warm-up) and in every replay."""
    ex = StackExecutor.start(
        load_stack("k3-mini-kda3-mla", 1, graph_batches=(4,)), device="cuda", log=lambda line: None
    )
    prefill(ex, {0: 2, 1: 3})
    stock_decode = ex.attention.kda_decode

    def rogue(packed, weights, cache, slots):
        out = stock_decode(packed, weights, cache, slots)
        cache.recurrent[0].add_(1.0)
        return out

    ex.attention.kda_decode = rogue
    null_slot = {(kda_state_name(layer, "recurrent"), (0, 1)) for layer in ex.config.kda_layers}
    captured = audit_capture(ex, 4, method="device")
    assert {(c.tensor, c.index[0]) for c in captured.changes} == null_slot, captured.summary()
    replayed = audit_step(ex, decode_requests(ex, [0, 1], seed=1), mode="graph", method="device")
    assert {(c.tensor, c.index[0]) for c in replayed.changes} == null_slot, replayed.summary()


def test_a_clean_capture_and_replay_pass_on_the_device():
    ex = StackExecutor.start(
        load_stack("k3-mini-kda3-mla", 1, graph_batches=(4,)), device="cuda", log=lambda line: None
    )
    prefill(ex, {0: 2, 1: 3})
    captured = audit_capture(ex, 4, method="device")
    assert captured.passed, captured.summary()
    replayed = audit_step(ex, decode_requests(ex, [0, 1], seed=1), mode="graph", method="device")
    assert replayed.passed, replayed.summary()
