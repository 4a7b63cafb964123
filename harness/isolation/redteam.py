"""Red team of the isolation stage (static part): changes that each leave the model's area in one way.

Each case builds a two-commit repository in the scratch folder and judges it with a real subject's code scope
through the stage's own path; the stage must FAIL. The runtime cases (a specialized step that writes another
request's KDA state, a step that runs stock while its ledger claims specialized) are broken providers of the
k3-hopper subject, so they live with it (k3_decode/isolation_redteam.py) and harness/redteam.toml lists both modules.
"""

from __future__ import annotations

from pathlib import Path

from harness.isolation import scratch
from harness.isolation.scope import for_subject
from harness.redteam import RedTeamCase
from harness.stages.isolation import records_for
from harness.verdicts import StageRecords

STAGE = "isolation"
MODEL = "vllm/models/kimi_k3/nvidia/model.py"

_MODEL_BASE = """import torch

from vllm.models.kimi_k3.nvidia.specialized_decode import runtime


class KimiK3Model(torch.nn.Module):
    def forward(self, x):
        plan = runtime.plan(x)
        if plan is not None:
            return runtime.run(plan, x)
        return self.stock(x)
"""


def _judge(tmp: Path, subject: str, base: dict[str, str], head: dict[str, str | None]) -> StageRecords:
    repo = tmp / "repo"
    base_rev, head_rev = scratch.two_commits(repo, base, head)
    return records_for(STAGE, repo, base_rev, head_rev, for_subject(subject))


def _shared_sampler(tmp: Path) -> StageRecords:
    sampler = "def sample(logits):\n    return logits.argmax(-1)\n"
    head = {
        MODEL: _MODEL_BASE + "\n# fast greedy path\n",
        "vllm/v1/sample/sampler.py": sampler.replace("argmax(-1)", "argmax(-1).int()"),
    }
    return _judge(tmp, "vllm-k3", {MODEL: _MODEL_BASE, "vllm/v1/sample/sampler.py": sampler}, head)


def _monkeypatch_functional(tmp: Path) -> StageRecords:
    patched = _MODEL_BASE.replace(
        "import torch\n",
        "import torch\nimport torch.nn.functional as F\n\nfrom vllm.models.kimi_k3.nvidia.ops import fused_silu\n\n"
        "F.silu = fused_silu  # every model in the process now runs our kernel\n",
    )
    return _judge(tmp, "vllm-k3", {MODEL: _MODEL_BASE}, {MODEL: patched})


def _except_fallback(tmp: Path) -> StageRecords:
    swallowing = _MODEL_BASE.replace(
        "            return runtime.run(plan, x)\n",
        "            try:\n"
        "                return runtime.run(plan, x)\n"
        "            except Exception:  # the stock path below takes over, unseen\n"
        "                pass\n",
    )
    return _judge(tmp, "vllm-k3", {MODEL: _MODEL_BASE}, {MODEL: swallowing})


def _env_numerics_switch(tmp: Path) -> StageRecords:
    switched = _MODEL_BASE.replace("import torch\n", "import os\n\nimport torch\n").replace(
        "        plan = runtime.plan(x)\n",
        '        if os.environ.get("K3_FAST_MATH") == "1":\n            x = x.to(torch.float16)\n'
        "        plan = runtime.plan(x)\n",
    )
    return _judge(tmp, "vllm-k3", {MODEL: _MODEL_BASE}, {MODEL: switched})


def _kernel_edits_tolerances(tmp: Path) -> StageRecords:
    kernel = "k3_decode/kernels/kda_decode.py"
    tolerances = "suites/tolerances.toml"
    base = {
        kernel: "def build(arch):\n    return arch\n",
        tolerances: '[kda_decode.float32]\natol = 1e-5\nwhy = "fp32"\n',
    }
    head = {
        kernel: "def build(arch):\n    return (arch, 'fast')\n",
        tolerances: base[tolerances].replace("1e-5", "1e-2"),
    }
    return _judge(tmp, "k3-hopper", base, head)


CASES = [
    RedTeamCase(STAGE, "shared-sampler", "a K3 change that also edits vllm/v1/sample/sampler.py", _shared_sampler),
    RedTeamCase(
        STAGE, "monkeypatch-functional", "model code that replaces torch.nn.functional.silu", _monkeypatch_functional
    ),
    RedTeamCase(STAGE, "except-fallback", "the specialized dispatch wrapped in try/except Exception", _except_fallback),
    RedTeamCase(
        STAGE, "env-numerics-switch", "an undeclared K3_FAST_MATH variable that drops to fp16", _env_numerics_switch
    ),
    RedTeamCase(
        STAGE,
        "kernel-loosens-tolerance",
        "a kernel change that also loosens suites/tolerances.toml",
        _kernel_edits_tolerances,
    ),
]
