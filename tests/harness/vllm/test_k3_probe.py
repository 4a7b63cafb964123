"""The Kimi K3 proof-of-path probe (k3_decode/vllm_probe.py) against a CPU stand-in for vLLM 0.33.0's K3 classes.

The fakes keep the names, signatures and decision logic of the real code they mirror (paths under
vllm/models/kimi_k3/nvidia/ in the vllm 0.33.0 wheel):
- `DecodeConfig`, `specialized_decode_config` (without unsupported()): specialized_decode/runtime/__init__.py:10-40.
- `SpecializedDecode.__init__` (batches, q): specialized_decode/runtime/decode.py:77-84, BATCHES from providers.py:24;
  `plan`: decode.py:193-227 with `decode_metadata` 42-53 and `is_uniform_verify` 56-65; `run` 229, `normalize` 264.
- `KimiLinearForCausalLM.__init__` / `build_specialized_decode` / `forward`: model.py:1435-1453 and 1473-1492.
- `KimiK3ForConditionalGeneration.forward`: model.py:1942-1957; `get_language_model`: interfaces.py:270.
- `KimiK3ModelState.__init__`: model_state.py:14-20.
Torch's capture flag and vLLM's forward context are a `World` the fake plan and the probe's test runtime both read.
Steps are driven through the plugin's PathRecorder the way its forward-context hook drives it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, NamedTuple

import pytest
import torch
from torch import nn

from harness.isolation import hygiene
from harness.isolation.scope import for_subject
from harness.runners import out_of_scope, pathproof
from harness.runners.findings import Findings
from harness.verdicts import Verdict, derive_verdict
from harness.vllm_plugin import hooks
from harness.vllm_plugin import recorder as recorder_mod
from harness.vllm_plugin.recorder import PathRecorder, StepInfo
from k3_decode import vllm_probe
from k3_decode.vllm_probe import StepView
from tests.harness.vllm import in_vllm

from .conftest import REPO

PROBE = "k3_decode.vllm_probe:install"
BATCHES = (*range(1, 9), 16, 32, 64)
PREPARED_MAX = BATCHES[-1]
CAPTURE_SIZES = (1, 2, 4, 8, 16, 32, 64)
LAYERS = 3


# --- the stand-in for vLLM 0.33.0 -----------------------------------------------------------------------------
@dataclass
class World:
    capturing: bool = False  # torch.cuda.is_current_stream_capturing()
    context: Any | None = None  # vllm.forward_context.get_forward_context(), None when unavailable
    veto: bool = False  # a predicate newer than the probe: plan() declines for a reason it does not model


class FakeRuntime:
    def __init__(self, world: World) -> None:
        self.world = world

    def view(self) -> StepView:
        ctx = self.world.context
        return StepView(self.world.capturing, ctx, ctx is not None and ctx.cudagraph_runtime_mode == "PIECEWISE")


@dataclass
class Metadata:
    num_prefills: int = 0
    num_decodes: int = 0
    num_decode_tokens: int = 0
    num_spec_decodes: int = 0
    num_spec_decode_tokens: int = 0
    spec_state_indices_tensor: Any = None


@dataclass
class ForwardContext:
    cudagraph_runtime_mode: str
    attn_metadata: dict[str, Metadata]
    slot_mapping: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class DecodeConfig:
    max_context: int
    mla_core: str
    dcp: int
    q: int
    capture_sizes: tuple[int, ...]


class Step(NamedTuple):
    q: int
    metadata: list
    slot_mapping: Any


def specialized_decode_config(backend: str, q: int) -> DecodeConfig | None:
    if backend == "auto":
        return None
    if backend != "latency_specialized":
        raise ValueError("Supported decode_backend values are auto/latency_specialized")
    return DecodeConfig(max_context=4096, mla_core="auto", dcp=1, q=q, capture_sizes=CAPTURE_SIZES)


def layer_name(module: Any) -> Any:
    return getattr(module, "prefix", getattr(module, "layer_name", None))


def is_uniform_verify(md: Metadata, q: int, b: int) -> bool:
    if md.num_prefills:
        return False
    rows, tokens = md.spec_state_indices_tensor, md.num_spec_decode_tokens
    full = rows is not None and rows.shape[0] * q == b
    return full and not md.num_decodes and tokens == md.num_spec_decodes * q


def decode_metadata(attention: Any, context: ForwardContext, q: int, b: int) -> Metadata | None:
    md = context.attn_metadata
    md = md.get(layer_name(attention)) if isinstance(md, dict) else None
    if md is None:
        return None
    if q > 1:
        return md if is_uniform_verify(md, q, b) else None
    if md.num_prefills or getattr(md, "num_spec_decodes", 0):
        return None
    return md


class SpecializedDecode:
    def __init__(self, backbone: Backbone, config: DecodeConfig) -> None:
        self.backbone, self.world = backbone, backbone.world
        q = config.q
        rounded = {-(-s // q) * q for s in config.capture_sizes}
        verify = {m for m in rounded if m <= PREPARED_MAX}
        self.batches, self.q = tuple(sorted({*BATCHES, *verify})), q
        self.layers = tuple(backbone.layers)

    def plan(self, positions: torch.Tensor, intermediate_tensors: Any) -> Step | None:
        b = positions.shape[0]
        if intermediate_tensors is not None or b not in self.batches:
            return None
        if not self.world.capturing:
            return None
        if self.world.context is None:
            return None
        context = self.world.context
        if context.cudagraph_runtime_mode == "PIECEWISE":
            return None
        by_layer = context.attn_metadata
        rows = list(by_layer.values()) if isinstance(by_layer, dict) else []
        q = self.q if any(getattr(md, "num_spec_decodes", 0) for md in rows) else 1
        if b % q:
            return None
        metadata = [decode_metadata(d.self_attn, context, q, b) for d in self.layers]
        if any(md is None for md in metadata) or self.world.veto:
            return None
        return Step(q, metadata, context.slot_mapping)

    def run(self, step: Step, input_ids: Any, inputs_embeds: Any) -> tuple[str, int]:
        return ("specialized", step.q)

    def normalize(self, output: Any) -> Any:
        return output


class Backbone(nn.Module):
    def __init__(self, world: World) -> None:
        super().__init__()
        self.world = world
        self.layers = [SimpleNamespace(self_attn=SimpleNamespace(prefix=f"model.layers.{i}.attn")) for i in range(3)]

    def forward(self, input_ids: Any, positions: torch.Tensor, intermediate_tensors: Any, inputs_embeds: Any) -> Any:
        return ("stock", int(positions.shape[0]))


class KimiLinearForCausalLM(nn.Module):
    def __init__(self, *, world: World, backend: str = "latency_specialized", q: int = 1) -> None:
        super().__init__()
        self.model = Backbone(world)
        self.specialized_decode_config = specialized_decode_config(backend, q)
        self.specialized_decode: SpecializedDecode | None = None
        self.needs_norm_in_logits = True

    def build_specialized_decode(self) -> None:
        self.specialized_decode = SpecializedDecode(self.model, self.specialized_decode_config)
        self.needs_norm_in_logits = False

    def forward(
        self,
        input_ids: Any,
        positions: torch.Tensor,
        intermediate_tensors: Any = None,
        inputs_embeds: Any = None,
        **kwargs: Any,
    ) -> Any:
        decode = self.specialized_decode
        if decode is not None:
            step = decode.plan(positions, intermediate_tensors)
            if step is not None:
                return decode.run(step, input_ids, inputs_embeds)
        hidden_states = self.model(input_ids, positions, intermediate_tensors, inputs_embeds, **kwargs)
        if not self.needs_norm_in_logits:
            assert decode is not None
            hidden_states = decode.normalize(hidden_states)
        return hidden_states


class KimiK3ForConditionalGeneration(nn.Module):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__()
        self.language_model = KimiLinearForCausalLM(**kwargs)

    def get_language_model(self) -> nn.Module:
        return self.language_model

    def forward(
        self,
        input_ids: Any,
        positions: torch.Tensor,
        intermediate_tensors: Any = None,
        inputs_embeds: Any = None,
        **kwargs: Any,
    ) -> Any:
        if intermediate_tensors is not None:
            inputs_embeds = None
        return self.language_model(
            input_ids=input_ids,
            positions=positions,
            intermediate_tensors=intermediate_tensors,
            inputs_embeds=inputs_embeds,
        )


class KimiK3ModelState:
    def __init__(self, vllm_config: Any, model: Any, encoder_cache: Any, device: Any) -> None:
        if hasattr(model, "get_language_model"):
            model = model.get_language_model()
        self.language_model = model
        if model.specialized_decode_config is not None:
            model.build_specialized_decode()


# --- driving steps ----------------------------------------------------------------------------------------------
def decode_ctx(tokens: int, mode: str = "NONE") -> ForwardContext:
    md = Metadata(num_decodes=tokens, num_decode_tokens=tokens)
    return ForwardContext(mode, {f"model.layers.{i}.attn": md for i in range(LAYERS)})


def prefill_ctx(tokens: int) -> ForwardContext:
    md = Metadata(num_prefills=1, num_decodes=tokens - 1, num_decode_tokens=tokens - 1)
    return ForwardContext("NONE", {f"model.layers.{i}.attn": md for i in range(LAYERS)})


def verify_ctx(tokens: int, q: int, uniform: bool) -> ForwardContext:
    reqs = tokens // q
    md = Metadata(
        num_spec_decodes=reqs,
        num_spec_decode_tokens=reqs * q if uniform else reqs * q - 1,
        spec_state_indices_tensor=torch.zeros(reqs, q),
    )
    return ForwardContext("NONE", {f"model.layers.{i}.attn": md for i in range(LAYERS)})


@dataclass
class Rig:
    world: World
    model: KimiK3ForConditionalGeneration
    rec: PathRecorder

    def step(
        self,
        tokens: int,
        ctx: ForwardContext | None,
        *,
        capturing: bool = False,
        shape: str = "decode",
        intermediate: Any = None,
        descriptor: str | None = None,
        mode: str = "NONE",
    ) -> Any:
        """One forward pass inside one recorder step, as the plugin's forward-context hook brackets it."""
        self.world.capturing, self.world.context = capturing, ctx
        self.rec.begin_step(StepInfo(mode, descriptor, shape, tokens, tokens))
        try:
            return self.model(None, torch.zeros(tokens, dtype=torch.long), intermediate_tensors=intermediate)
        finally:
            self.rec.end_step()


def rig(tmp_path: Path, *, backend: str = "latency_specialized", q: int = 1, build: bool = True) -> Rig:
    world = World()
    model = KimiK3ForConditionalGeneration(world=world, backend=backend, q=q)
    rec = PathRecorder(tmp_path, type(model).__name__, {"decode_backend": backend})
    vllm_probe.install(model, rec.decide, FakeRuntime(world))
    rec.set_probe(PROBE, "")
    if build:
        KimiK3ModelState(None, model, None, "cpu")  # after loading, as the V2 runner does (init_model_state)
    return Rig(world, model, rec)


# --- planned, fell back, no decode -------------------------------------------------------------------------------
def test_a_planned_step_is_counted_specialized(tmp_path):
    r = rig(tmp_path)
    # The V2 runner captures a FULL graph with runtime mode NONE and no batch descriptor (cudagraph_utils.py).
    out = r.step(4, decode_ctx(4), capturing=True)
    assert out == ("specialized", 1)
    assert r.rec.by_path == {"decode:specialized": 1} and not r.rec.fallback_reasons
    assert r.rec.timeline[0]["reason"] == "planned 4 tokens, q=1" and r.rec.timeline[0]["source"] == "planned"


def test_a_capture_decision_is_credited_to_the_replays_of_its_descriptor(tmp_path, monkeypatch):
    # Where the forward context names the graph's batch descriptor at capture, every later replay of that
    # descriptor inherits the decision; replays run no model Python, so the probe is not called for them.
    monkeypatch.setattr(recorder_mod, "_capturing", lambda: True)
    r = rig(tmp_path)
    desc = "tokens=8,reqs=8,uniform=True"
    assert r.step(8, decode_ctx(8, "FULL"), capturing=True, descriptor=desc, mode="FULL") == ("specialized", 1)
    assert r.rec.captured[desc]["path"] == "specialized"
    for _ in range(3):
        r.rec.begin_step(StepInfo("FULL", desc, "decode", 8, 8))
        r.rec.end_step()
    assert r.rec.by_path == {"decode:specialized": 4}
    assert [t["source"] for t in r.rec.timeline] == ["planned", "replay", "replay", "replay"]


SIZES = ", ".join(str(b) for b in BATCHES)
FALLBACKS = {
    "eager decode": (dict(tokens=4, ctx=decode_ctx(4)), vllm_probe.NOT_CAPTURING),
    # plan() tests the capture before the context: a profiling step outside any context is "not capturing".
    "profiling, no context": (dict(tokens=4, ctx=None), vllm_probe.NOT_CAPTURING),
    "prefill": (
        dict(tokens=100, ctx=prefill_ctx(100), capturing=True, shape="prefill_or_mixed"),
        "more than 64 tokens (the largest prepared batch)",
    ),
    "unprepared batch": (
        dict(tokens=12, ctx=decode_ctx(12), capturing=True),
        f"12 tokens is not a prepared batch size ({SIZES})",
    ),
    "piecewise": (dict(tokens=4, ctx=decode_ctx(4, "PIECEWISE"), capturing=True), vllm_probe.PIECEWISE),
    "no forward context": (dict(tokens=4, ctx=None, capturing=True), vllm_probe.NO_CONTEXT),
    "prompt rows": (
        dict(tokens=4, ctx=prefill_ctx(4), capturing=True, shape="prefill_or_mixed"),
        vllm_probe.PROMPT_ROWS,
    ),
    "pipeline stage": (dict(tokens=4, ctx=decode_ctx(4), capturing=True, intermediate={"h": 0}), vllm_probe.PIPELINE),
}


@pytest.mark.parametrize("case", list(FALLBACKS))
def test_a_fallback_is_counted_stock_with_plans_reason(tmp_path, case):
    kwargs, reason = FALLBACKS[case]
    r = rig(tmp_path)
    out = r.step(**kwargs)
    assert out[0] == "stock"  # the stand-in of plan() declined: the stock forward ran
    shape = kwargs.get("shape", "decode")
    assert r.rec.by_path == {f"{shape}:stock": 1}
    assert r.rec.fallback_reasons == {f"{shape}: {reason}": 1}


def test_speculative_steps_fall_back_with_the_verify_reason(tmp_path):
    r = rig(tmp_path, q=3)  # DSpark with 2 draft tokens: verify steps carry 3 tokens per request
    assert r.step(6, verify_ctx(6, 3, uniform=True), capturing=True) == ("specialized", 3)
    assert r.step(4, verify_ctx(3, 3, uniform=True), capturing=True)[0] == "stock"
    assert r.step(6, verify_ctx(6, 3, uniform=False), capturing=True)[0] == "stock"
    assert r.rec.by_path == {"decode:specialized": 1, "decode:stock": 2}
    assert r.rec.fallback_reasons == {
        "decode: 4 tokens is not a whole number of 3-token verify requests": 1,
        "decode: a speculative step whose requests do not all verify 3 tokens": 1,
    }


def test_a_decline_the_probe_cannot_explain_says_so(tmp_path):
    # A predicate added to plan() after the probe was written: still counted stock, never given a wrong reason.
    r = rig(tmp_path)
    r.world.veto = True
    assert r.step(4, decode_ctx(4), capturing=True)[0] == "stock"
    assert r.rec.fallback_reasons == {f"decode: {vllm_probe.UNEXPLAINED}": 1}


def test_the_stock_backend_reports_every_step_stock(tmp_path):
    r = rig(tmp_path, backend="auto")
    assert r.model.language_model.specialized_decode is None  # the model state builds nothing for "auto"
    r.step(40, prefill_ctx(40), shape="prefill_or_mixed")
    r.step(4, decode_ctx(4), capturing=True)
    assert r.rec.by_path == {"prefill_or_mixed:stock": 1, "decode:stock": 1}
    assert set(r.rec.fallback_reasons) == {f"{s}: {vllm_probe.NO_DECODE}" for s in ("prefill_or_mixed", "decode")}
    unbuilt = rig(tmp_path / "unbuilt", build=False)  # configured, but the model state has not run yet
    unbuilt.step(4, decode_ctx(4), capturing=True)
    assert unbuilt.rec.fallback_reasons == {f"decode: {vllm_probe.NOT_BUILT}": 1}


def test_installing_twice_reports_each_decision_once():
    world, calls = World(), []
    model = KimiK3ForConditionalGeneration(world=world)
    for _ in range(2):
        vllm_probe.install(model, lambda path, reason: calls.append(path), FakeRuntime(world))
    KimiK3ModelState(None, model, None, "cpu")
    world.capturing, world.context = True, decode_ctx(4)
    model(None, torch.zeros(4, dtype=torch.long))
    assert calls == ["specialized"]


def test_a_decode_without_plan_is_left_unobserved_and_logged(caplog):
    # Raising inside the model state would crash the server; unobserved steps never count as specialized.
    decode = SimpleNamespace(plan=lambda positions, intermediate: None, q=1)
    with caplog.at_level("WARNING", logger="k3gate.vllm_probe"):
        assert vllm_probe.watch_plan(decode, lambda path, reason: None, FakeRuntime(World())) is False
    assert "has no batches" in caplog.text and decode.plan(None, None) is None


def test_the_probe_changes_only_the_models_own_instances(tmp_path):
    r = rig(tmp_path)
    text = r.model.language_model
    assert "forward" in vars(text) and "build_specialized_decode" in vars(text)
    assert "plan" in vars(text.specialized_decode)
    # The classes are untouched: another instance of the same model is not observed.
    assert KimiLinearForCausalLM.forward.__qualname__ == "KimiLinearForCausalLM.forward"
    assert SpecializedDecode.plan.__qualname__ == "SpecializedDecode.plan"
    other = KimiK3ForConditionalGeneration(world=r.world)
    assert "forward" not in vars(other.language_model)


# --- no hook: coverage is not judged ----------------------------------------------------------------------------
class LlamaLike(nn.Module):
    """A model the K3 entry point could be pointed at by mistake: a forward and nothing to plan with."""

    def forward(self, input_ids: Any, positions: torch.Tensor) -> Any:
        return positions


def loaded_through_the_plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, model: nn.Module) -> dict[str, Any]:
    """hooks.on_model_loaded as the worker runs it, with this probe registered for the model's class name."""
    monkeypatch.setenv("K3GATE_PATH_DIR", str(tmp_path))
    monkeypatch.setenv("K3GATE_PATH_PROBES", f"{type(model).__name__}={PROBE}")
    monkeypatch.delenv("K3GATE_PERTURB", raising=False)
    monkeypatch.setattr(hooks, "_recorder", None)
    monkeypatch.setattr(PathRecorder, "start", lambda self: self.flush(force=True))  # no flusher thread in tests
    hooks.on_model_loaded(model, SimpleNamespace(additional_config={"decode_backend": "latency_specialized"}))
    return pathproof.read(tmp_path)


def rocm_model() -> nn.Module:
    # Same hook names as the NVIDIA model, other plan() predicates (vllm/models/kimi_k3/amd/).
    cls = type("KimiLinearForCausalLM", (KimiLinearForCausalLM,), {"__module__": "vllm.models.kimi_k3.amd.linear"})
    return cls(world=World())


@pytest.mark.parametrize(
    ("make", "missing"),
    [
        (lambda: type("KimiLinearForCausalLM", (LlamaLike,), {})(), "has no specialized_decode_config"),
        (rocm_model, "vLLM's ROCm Kimi K3"),
    ],
)
def test_a_model_without_the_hook_leaves_coverage_not_run(tmp_path, monkeypatch, make, missing):
    snaps = loaded_through_the_plugin(tmp_path, monkeypatch, make())
    (snap,) = snaps.values()
    assert snap["probe"] is None and missing in snap["probe_note"] and "failed to install" in snap["probe_note"]
    path = pathproof.cell_path({}, snaps, 0.0)
    check, why = pathproof.coverage_check("c=1", path, 1.0)
    assert check is None and missing in why
    findings = Findings("evals")
    findings.cannot(why)
    verdict = derive_verdict(findings.records().to_json())
    assert verdict.verdict is Verdict.NOT_RUN and missing in verdict.reason  # never PASSED
    check, why = out_of_scope.fallback_check("eager", path)
    assert check is None and "no probe can show it fell back" in why


def test_the_plugin_installs_the_probe_on_the_k3_model(tmp_path, monkeypatch):
    # The stock backend, so the step is decided without the real runtime (vLLM is not in this interpreter).
    model = KimiK3ForConditionalGeneration(world=World(), backend="auto")
    snaps = loaded_through_the_plugin(tmp_path, monkeypatch, model)
    assert next(iter(snaps.values()))["probe"] == PROBE
    rec = hooks.recorder()
    assert rec is not None
    KimiK3ModelState(None, model, None, "cpu")
    rec.begin_step(StepInfo("NONE", None, "decode", 4, 4))
    model(None, torch.zeros(4, dtype=torch.long))
    rec.end_step()
    assert rec.by_path == {"decode:stock": 1} and rec.fallback_reasons == {f"decode: {vllm_probe.NO_DECODE}": 1}


# --- out-of-scope deployments that start -------------------------------------------------------------------------
def judged(tmp_path: Path, r: Rig, steps: list[dict[str, Any]]) -> tuple[Any, str | None]:
    r.rec.flush(force=True)
    before = pathproof.read(tmp_path)
    for kwargs in steps:
        if kwargs.get("unobserved"):  # a decode step the probe never heard of
            r.rec.begin_step(StepInfo("NONE", None, "decode", 4, 4))
            r.rec.end_step()
        else:
            r.step(**kwargs)
    start = before[next(iter(before))]["written_at"]
    r.rec.flush(force=True)
    return out_of_scope.fallback_check("eager", pathproof.cell_path(before, pathproof.read(tmp_path), start))


def test_a_started_out_of_scope_server_must_fall_back_visibly(tmp_path):
    prompt = dict(tokens=20, ctx=prefill_ctx(20), shape="prefill_or_mixed")
    decode = dict(tokens=1, ctx=decode_ctx(1))
    check, why = judged(tmp_path / "stock", rig(tmp_path / "stock", backend="auto"), [prompt, decode, decode])
    assert why is None and check.passed and check.value == 2
    # Broken cases: it planned a specialized step, the probe missed a step, or no decode step was seen.
    captured = dict(tokens=1, ctx=decode_ctx(1), capturing=True)
    check, _ = judged(tmp_path / "planned", rig(tmp_path / "planned"), [prompt, decode, captured])
    assert not check.passed and "1/2 decode steps specialized" in check.detail
    check, _ = judged(tmp_path / "silent", rig(tmp_path / "silent", backend="auto"), [decode, {"unobserved": True}])
    assert not check.passed and check.value == 1 and check.limit == 2
    check, _ = judged(tmp_path / "idle", rig(tmp_path / "idle", backend="auto"), [prompt])
    assert not check.passed and "unproven" in check.detail


def test_a_stale_snapshot_is_not_judged(tmp_path):
    r = rig(tmp_path, backend="auto")
    r.rec.flush(force=True)
    snaps = pathproof.read(tmp_path)
    path = pathproof.cell_path(snaps, snaps, after_time=next(iter(snaps.values()))["written_at"] + 1)
    check, why = out_of_scope.fallback_check("eager", path)
    assert check is None and "no fresh proof-of-path snapshot" in why


# --- the probe is instrumentation the isolation rules accept ----------------------------------------------------
def test_the_probe_passes_the_isolation_hygiene_rules():
    text = (REPO / "k3_decode" / "vllm_probe.py").read_text()
    assert hygiene.check_source("k3_decode/vllm_probe.py", text, for_subject("k3-hopper")) == []


def test_patching_vllms_class_instead_would_be_flagged():
    # The same probe written the tempting way: patch SpecializedDecode.plan on vLLM's class, for every instance.
    broken = (
        "from vllm.models.kimi_k3.nvidia.specialized_decode.runtime.decode import SpecializedDecode\n"
        "def install(model, decide):\n"
        "    plan = SpecializedDecode.plan\n"
        "    def probed(self, positions, intermediate_tensors):\n"
        "        step = plan(self, positions, intermediate_tensors)\n"
        "        decide('stock' if step is None else 'specialized', '')\n"
        "        return step\n"
        "    SpecializedDecode.plan = probed\n"
    )
    found = hygiene.check_source("k3_decode/vllm_probe.py", broken, for_subject("k3-hopper"))
    assert [(f.rule, f.line) for f in found] == [(hygiene.MONKEYPATCH, 8)]


# --- the real runtime, in vLLM's own interpreter ------------------------------------------------------------------
RUNTIME_SCRIPT = """
import json
from vllm.config import CUDAGraphMode, VllmConfig
from vllm.forward_context import set_forward_context
from k3_decode.vllm_probe import VllmRuntime
rt, out = VllmRuntime(), {}
out["outside"] = rt.view().__dict__ | {"context": rt.view().context is not None}
cfg = VllmConfig()
for mode in ("PIECEWISE", "NONE"):
    with set_forward_context({"model.layers.0.attn": 1}, cfg, cudagraph_runtime_mode=CUDAGraphMode[mode]):
        v = rt.view()
        out[mode] = {"capturing": v.capturing, "piecewise": v.piecewise, "metadata": list(v.context.attn_metadata)}
print(json.dumps(out))
"""


@pytest.mark.slow
def test_the_real_runtime_reads_vllms_forward_context(vllm_python):
    out = in_vllm.json_from(vllm_python, RUNTIME_SCRIPT)
    assert out["outside"] == {"capturing": False, "context": False, "piecewise": False}
    assert out["PIECEWISE"] == {"capturing": False, "piecewise": True, "metadata": ["model.layers.0.attn"]}
    assert out["NONE"]["piecewise"] is False and out["NONE"]["metadata"] == ["model.layers.0.attn"]
