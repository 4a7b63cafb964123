"""k3gate's vLLM general plugin: proof of path, red-team perturbations, and the teacher-forcing logits processor.

vLLM calls `register()` in every process it starts (API server, engine core, workers) through the
`vllm.general_plugins` entry point. The plugin is inert unless the gate asks for it through the environment:

- K3GATE_PATH_DIR: record, per forward step of the target model, the CUDA-graph runtime mode and batch descriptor,
  the batch shape, and (through a model's path probe) whether its specialized decode planned or fell back. Counts
  go to `<dir>/path-<pid>.json`, rewritten atomically while the server runs. Steps are seen where vLLM enters a
  forward context (hooks.py) and, for the V2 model runner's FULL CUDA graphs, which replay without one, at the
  runner's graph manager (graphs.py). A drafter loaded after the target is named in the same file and its own
  steps are counted apart (models.py).
- K3GATE_PATH_PROBES: "Architecture=module:function;..." probes to use in addition to the `k3gate.path_probes`
  entry points (tests use it to install a probe without packaging one).
- K3GATE_PERTURB: a deliberate bug for the red team ("nudge_logits[:strength]", "break_structured",
  "wrong_sampler"); never set it outside red-team runs.

Patching vLLM internals is what an external instrument has to do to observe a server it does not own; the
isolation rules for the model code under review do not apply to the judge. Two hooks patch vLLM itself (the
forward-context override and BaseModelLoader.load_model, hooks.py); everything added since wraps bound methods of
the instances the plugin reaches through them (the runner, its graph manager, a drafter), which the isolation
rules would accept even in model code.
"""

from __future__ import annotations

import os

PATH_DIR_ENV = "K3GATE_PATH_DIR"
PROBES_ENV = "K3GATE_PATH_PROBES"
PERTURB_ENV = "K3GATE_PERTURB"

_registered = False


def register() -> None:
    """The `vllm.general_plugins` entry point; safe to call more than once per process."""
    global _registered
    if _registered or not (os.environ.get(PATH_DIR_ENV) or os.environ.get(PERTURB_ENV)):
        return
    _registered = True
    from harness.vllm_plugin import hooks

    hooks.install()
