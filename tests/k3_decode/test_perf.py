"""The k3-hopper perf suite on the CPU (k3-mini), its backend resolution, and the cpu-smoke perf run end to end."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from dataclasses import dataclass, field

import pytest
import torch

from harness.bundle.verify import verify
from harness.cli import main
from harness.perf.checks import sweep_checks
from harness.perf.measure import measure_cell
from harness.perf.plan import Cell, PerfConfigError, Region, Settings
from k3_decode.isolation_redteam import RedTeamKdaProvider, private_scope, private_table
from k3_decode.kernels.providers import not_built_reason
from k3_decode.perf import ArmBackend, K3PerfSuite, resolve_backend
from k3_decode.runtime.backend import ProviderRegistry
from k3_decode.runtime.optable import load_op_table

QUICK = Settings(warmup=1, min_repeats=3, max_repeats=4, ci_target_rel_width=0.5, l2_flush=False, profile_repeats=1)
LOOSE = Region("all", (1, 64), 1.0)  # CPU timings on a shared machine: the plumbing is under test, not the speed


def _cell(batch: int = 2, context: int = 9, workload: str = "decode", q: int = 1, tp: int = 1, **kw) -> Cell:
    extra = {"prefill_tokens": 2} if workload == "mixed" else {}
    if q > 1:
        extra["acceptance_rate"] = 0.5
    return Cell("t", workload, kw.get("routing", "synthetic"), tp, kw.get("dcp", 1), batch, context, q, **extra)


def _suite(*cells: Cell, **kw) -> K3PerfSuite:
    return K3PerfSuite("k3-hopper", "k3-mini", cells, QUICK, "cpu", **kw)


@pytest.mark.skipif(not_built_reason() is None, reason="the CuTe DSL kernels can run here (an sm_90 GPU)")
def test_backends_resolve_and_the_unbuilt_specialized_path_says_so():
    assert resolve_backend("perf.baseline_backend", "auto") == ArmBackend("auto", "auto", "stock")
    cand = resolve_backend("perf.candidate_backend", "latency_specialized")
    assert (cand.started, cand.expected) == ("auto", "stock") and "not built" in cand.note
    # The kernels package was asked (as start-up asks it), and its reason is in the note.
    assert f"no provider for attn_res, in_proj, kda, o_proj: {not_built_reason()}" in cand.note
    with pytest.raises(PerfConfigError, match=r"perf.candidate_backend: 'fast' is not a decode backend — use one of"):
        resolve_backend("perf.candidate_backend", "fast")


@dataclass(frozen=True)
class _Provider:
    op: str
    name: str
    launches: dict[str, int]


def test_a_built_specialized_backend_is_started_and_expected():
    table = load_op_table()
    registry = ProviderRegistry()
    for op in table.specialized_ops():
        registry.register(_Provider(op, f"fake-{op}", {f"k_{op}": 1}))
    assert resolve_backend("perf.candidate_backend", "latency_specialized", table, registry) == ArmBackend(
        "latency_specialized", "latency_specialized", "specialized"
    )


def test_cells_the_executor_cannot_measure_are_refused_with_a_fix():
    suite = _suite(_cell())
    assert "DCP=1 only" in suite.unsupported(_cell(dcp=2))
    assert "routing = 'synthetic'" in suite.unsupported(_cell(routing="real"))
    assert suite.unsupported(_cell()) is None
    assert "per-rank-shapes" in _suite(_cell(), distributed=True).unsupported(_cell())


def test_the_report_notes_say_what_the_numbers_are():
    info = _suite(_cell()).info
    text = " ".join(info.notes)
    assert "numbers mean nothing" in text and "ratio is ~1 by construction" in text and "stack k3-mini-kda3-mla" in text
    assert info.numbers_meaningful is False and "TTFT" not in info.ttft and "not measured" in info.ttft
    assert "numbers mean nothing" in info.figure_note


@pytest.fixture(scope="module")
def measured():
    """One decode, one mixed and one verify cell at TP1, measured like the stage does (shared: the CPU is slow)."""
    cells = (_cell(2), _cell(1, workload="mixed"), _cell(2, q=2))
    suite = _suite(*cells)
    out = {}
    for c in cells:
        prepared = suite.prepare(c, QUICK)
        out[c.workload + str(c.tokens_per_request)] = (prepared, measure_cell(prepared, c, LOOSE, QUICK, lambda: {}))
    yield suite, out
    suite.close()


def test_every_check_passes_on_the_stock_arms(measured):
    suite, out = measured
    bandwidth = suite.bandwidth()
    for _, result in out.values():
        judged = suite.info.numbers_meaningful  # on the CPU A/A timing noise is recorded, not judged
        failed = [c.describe() for c in sweep_checks([result], 1, bandwidth, 0.5, judged) if not c.passed]
        assert failed == [], failed
        assert result.paths["candidate"].expected == "stock" and result.backends["candidate"].endswith("(ran auto)")


def test_profiles_split_the_step_into_its_layers(measured):
    _, out = measured
    _, decode = out["decode1"]
    parts = decode.profiles["baseline"].parts
    assert [p.name for p in parts] == ["layer 4 kda+moe", "layer 5 kda+moe", "layer 6 kda+moe", "layer 7 mla+moe"]
    assert all(p.time_s > 0 and p.bytes and p.launches is None for p in parts)
    assert sum(p.bytes for p in parts) == decode.step_bytes
    assert 0.5 < decode.profiles["baseline"].parts_s / decode.profiles["baseline"].total_s <= 1.0


def test_timed_runs_leave_every_request_where_the_cell_put_it(measured):
    """A timed step that advanced its requests would time a longer context each run (and overrun max_context)."""
    _, out = measured
    for prepared, _ in out.values():
        for arm in (prepared.baseline, prepared.candidate):
            before = dict(arm.contexts)
            for _ in range(3):
                arm.run()
            assert {r: arm.ex.state.context_lens[r] for r in before} == before
    mixed = out["mixed1"][0].baseline
    assert mixed.contexts == {0: 9, 1: 0}  # the prefill request starts a new prompt each run


def test_a_verify_cell_runs_verify_steps_on_a_speculative_stack(measured):
    """q = 2: each timed step is one verify iteration (the ledger's records carry q = 2, the KDA layers ran the stock
    verify op, never a decode op), over the decode cell's weights, and leaves no unconfirmed tokens behind."""
    _, out = measured
    prepared, _ = out["decode2"]
    arm = prepared.baseline
    assert arm.ex.config.num_speculative_tokens == 1
    assert arm.ex.weights[4].attention is out["decode1"][0].baseline.ex.weights[4].attention
    window = arm.ex.ledger.since(arm._since).records()
    assert window and {r.tokens_per_request for r in window} == {2}
    ops = {e.record.op for e in arm.ex.op_log if e.layer in arm.ex.config.kda_layers}
    assert "kda_verify" in ops and "kda_decode" not in ops, ops
    assert all(arm.ex.state.unconfirmed[r] == 0 for r in arm.contexts)


def test_the_arms_are_separate_executors_over_shared_weights(measured):
    _, out = measured
    prepared, _ = out["decode1"]
    base, cand = prepared.baseline.ex, prepared.candidate.ex
    assert base is not cand and base.state is not cand.state and base.ledger is not cand.ledger
    assert base.weights[4].attention is cand.weights[4].attention


def test_bytes_grow_with_batch_and_only_the_mla_layer_with_context():
    suite = _suite(_cell(1, 9), _cell(4, 9), _cell(1, 30))
    ex = suite._stack_for(1).arms["baseline"]
    small, wide, long = (suite._part_bytes(ex, c) for c in (_cell(1, 9), _cell(4, 9), _cell(1, 30)))
    assert all(wide[i] > small[i] for i in small)
    assert long[7] > small[7] and all(long[i] == small[i] for i in (4, 5, 6))
    suite.close()


def test_an_arm_expecting_another_path_fails_its_ledger_check(measured):
    _, out = measured
    arm = out["decode1"][0].candidate
    honest = arm.arm_backend
    arm.arm_backend = ArmBackend("latency_specialized", "auto", "specialized")
    try:
        report = arm.path()
    finally:
        arm.arm_backend = honest
    assert report.expected == "specialized" and report.mismatches and "ran stock" in report.mismatches[0]


@pytest.mark.slow
def test_cpu_smoke_perf_passes_and_its_report_holds_the_plot(tmp_path, capsys):
    out = tmp_path / "b"
    assert main(["run", "--config", "cpu-smoke", "--stages", "perf", "--out", str(out), "--json", "--quiet"]) == 0
    summary = json.loads(capsys.readouterr().out)
    verdicts = {v["stage"]: v["verdict"] for v in summary["verdicts"]}
    assert summary["outcome"] == "PASSED" and verdicts["perf"] == "PASSED"
    report = (out / "report" / "report.md").read_text()
    assert "![perf: pareto.png](../stages/perf/pareto.png)" in report and "numbers mean nothing" in report
    assert "src='data:image/png;base64," in (out / "report" / "report.html").read_text()
    assert (out / "stages" / "perf" / "pareto.png").read_bytes()[:4] == b"\x89PNG"
    assert verify(out).ok


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_graph_and_eager_cells_at_k3_mini_dims():
    settings = Settings(warmup=2, min_repeats=5, max_repeats=20, profile_repeats=2)
    cells = (_cell(2), _cell(2, workload="mixed"))
    suite = K3PerfSuite("k3-hopper", "k3-mini", cells, settings, "cuda")
    try:
        for c in cells:
            prepared = suite.prepare(c, settings)
            assert prepared.mode == ("cuda-graph replay" if c.workload == "decode" else "eager (cuda)")
            result = measure_cell(prepared, c, LOOSE, settings)
            checks = sweep_checks([result], 1, suite.bandwidth(), 0.5)
            assert [x.describe() for x in checks if not x.passed] == []
            assert all(p.launches and p.launches > 0 for p in result.profiles["baseline"].parts)
            assert result.clocks_before.get("available") is True
    finally:
        suite.close()


@dataclass
class _CountingKdaProvider:
    """A test double of a specialized KDA decode (the isolation red team's honest one) whose launch counter plays
    the device-side counter; with `miss` = n its n-th launch goes uncounted, as a kernel that did not run would."""

    miss: int = 0
    op: str = "kda"
    name: str = "counting-kda"
    launches: dict[str, int] = field(default_factory=lambda: {"K3CountingKda": 1})
    calls: list[int] = field(default_factory=lambda: [0, 0])  # launches, counted launches
    by_call: Counter = field(default_factory=Counter)  # launches per runner call (kda_decode, kda_verify)

    def bind(self, target):
        honest = RedTeamKdaProvider("honest").bind(target)

        def counting(call):
            def counted(*args):
                self.by_call[call] += 1
                self.calls[0] += 1
                self.calls[1] += self.calls[0] != self.miss
                return honest[call](*args)

            return counted

        return {call: counting(call) for call in honest}

    def device_counts(self) -> dict[str, int]:
        return {"K3CountingKda": self.calls[1]}


def _specialized_cells(provider: _CountingKdaProvider) -> dict[str, list[str]]:
    """A decode, a verify and a mixed cell in that order on one pair of executors (as the stage runs them), the
    candidate latency_specialized with `provider` alone: each cell's candidate ledger mismatches."""
    registry = ProviderRegistry()
    registry.register(provider)
    settings = dataclasses.replace(QUICK, candidate_backend="latency_specialized")
    cells = (_cell(2), _cell(2, q=2), _cell(1, workload="mixed"))
    suite = K3PerfSuite(
        "k3-hopper", "k3-mini", cells, settings, "cpu", registry=registry, scope=private_scope(), table=private_table()
    )
    out = {}
    try:
        for c in cells:
            prepared = suite.prepare(c, settings)
            result = measure_cell(prepared, c, LOOSE, settings, lambda: {})
            out[c.id] = list(result.paths["candidate"].mismatches)
            baseline = list(result.paths["baseline"].mismatches)
            assert baseline == [], f"{c.id}: the stock arm was judged on launches it did not make: {baseline}"
    finally:
        suite.close()
    return out


def test_each_cell_is_judged_on_its_own_dispatches_and_the_device_counters():
    """The first H200 A/B with every provider registered failed 9 honest cells: a verify cell expecting stock was
    judged on an earlier cell's specialized steps, and no cell read the providers' device counters. The second
    failed 6 stock arms: the counters are per kernel and process (both arms' registries hold the provider, as here),
    and the interleaved candidate's launches were counted against the baseline."""
    provider = _CountingKdaProvider()
    mismatches = _specialized_cells(provider)
    assert len(mismatches) == 3 and all(m == [] for m in mismatches.values()), mismatches
    # The decode cell's expectations held the KDA core specialized, and it ran; the verify cell ran it through the
    # verify call (its own speculative stack), not as q decode iterations.
    assert provider.by_call["kda_decode"] > 0 and provider.by_call["kda_verify"] > 0, provider.by_call


def test_a_specialized_kernel_the_counters_did_not_see_fails_its_cell():
    mismatches = _specialized_cells(_CountingKdaProvider(miss=1))
    decode = mismatches[_cell(2).id]
    assert any(m.startswith("kernel K3CountingKda:") and "but the device counters show" in m for m in decode), decode
    # Only the cell the missing launch belongs to fails: the later cells count from their own start.
    assert mismatches[_cell(2, q=2).id] == [] and mismatches[_cell(1, workload="mixed").id] == []
