"""Each rule: code that must be flagged (with the line) and look-alike code that must not be."""

from __future__ import annotations

import textwrap

import pytest

from harness.isolation import hygiene
from harness.isolation.scope import parse

SCOPE = parse(
    {
        "model": ["pkg/models/m/**"],
        "env_modules": ["pkg.envs"],
        "env": {"PKG_DECLARED": "a reviewer accepted it"},
        "registrations": {"pkg.registry.REGISTRY.register_processor": "the model's own processor"},
    },
    "test",
)
PATH = "pkg/models/m/model.py"


def findings(src: str, rule: str | None = None, accepted: bool = False):
    found = hygiene.check_source(PATH, textwrap.dedent(src), SCOPE)
    return [(f.line, f.rule) for f in found if (rule is None or f.rule == rule) and bool(f.accepted) is accepted]


MONKEYPATCH = [
    ("import torch.nn.functional as F\nF.silu = lambda x: x\n", 2),
    ("import torch\ntorch.nn.functional.silu = None\n", 2),
    ("from torch.nn import functional\nfunctional.gelu = None\n", 2),
    ("from torch import nn\nnn.Linear.forward = None\n", 2),
    ("import torch\ndef f():\n    torch.backends.cuda.matmul.allow_tf32 = True\n", 3),
    ("import torch\ndef f(x):\n    torch.ops.mylib.attr += x\n", 3),
    ("import torch.nn.functional as F\nsetattr(F, 'silu', None)\n", 2),
    ("import torch.nn.functional as F\ndelattr(F, 'silu')\n", 2),
    ("import torch.nn.functional as F\ndel F.silu\n", 2),
    ("import os\nos.environ['X'] = '1'\n", 2),
    ("import os\ndef f():\n    del os.environ['X']\n", 3),
    ("import os\nos.environ.update(X='1')\n", 2),
    ("import sys\nsys.path.append('x')\n", 2),
    ("from pkg.registry import TABLE\nTABLE['m'] = 1\n", 2),
    ("import pkg.layers as L\nclass A:\n    def f(self):\n        L.Linear.weight_loader = None\n", 4),
    ("import torch\nx = lambda: setattr(torch, 'x', 1)\n", 2),
    ("import torch.nn.functional as F\ntry:\n    import F2\nexcept ImportError:\n    F = None\nF.silu = 1\n", 6),
    # A class attribute does not shadow a module for the methods of the class (Python's scoping rule).
    ("import torch\nclass A:\n    torch = None\n    def f(self):\n        torch.x = 1\n", 5),
]

NOT_MONKEYPATCH = [
    "import torch\nclass M(torch.nn.Module):\n    def __init__(self):\n        self.silu = torch.nn.functional.silu\n",
    "import torch\ndef f(torch):\n    torch.x = 1\n",  # a parameter shadows the import
    "import torch\ndef f():\n    torch = object()\n    torch.x = 1\n",
    "import torch\nx = torch.add(torch.ones(1), 1)\ny = torch.cat([x]).add(1)\n",  # functions and tensors
    "from . import ops\nops.TABLE = {}\n",  # the model's own package (relative)
    "from pkg.models.m import ops\nops.TABLE = {}\n",  # the model's own package (absolute)
    "import torch\ndef f(self, name, p):\n    setattr(self, name, p)\n",
    "import numpy as np\nnp.add(1, 2)\n",
    "CACHE = {}\nCACHE['k'] = 1\n",
    "import torch\nclass A:\n    torch = None\n    def f(self):\n        x = [1]\n        x.append(2)\n",
]


@pytest.mark.parametrize(("src", "line"), MONKEYPATCH)
def test_monkeypatching_is_flagged(src, line):
    assert (line, hygiene.MONKEYPATCH) in findings(src), findings(src)


@pytest.mark.parametrize("src", NOT_MONKEYPATCH)
def test_own_state_is_not_monkeypatching(src):
    assert findings(src, hygiene.MONKEYPATCH) == []


REGISTRY = [
    ("from pkg.registry import ModelRegistry\nModelRegistry.register_model('m', object)\n", 2),
    ("from pkg.ops import CustomOp\n@CustomOp.register('m_norm')\nclass Norm:\n    pass\n", 2),
    ("from pkg.ops import register_backend\n@register_backend\ndef backend():\n    pass\n", 2),
    ("import torch\ntorch.library.define('m::f', '(Tensor x) -> Tensor')\n", 2),
    ("import torch\n@torch.library.custom_op('m::f', mutates_args=())\ndef f(x):\n    return x\n", 2),
    ("import torch\ntorch.ops.load_library('libm.so')\n", 2),
    ("import torch\nif torch.cuda.is_available():\n    torch.library.impl('m::f', 'cuda')\n", 3),
    ("from pkg.r import register\ndef _setup():\n    register('m')\n_setup()\n", 4),
    ("from pkg.r import register\ndef _a():\n    register('m')\ndef _b():\n    _a()\n_b()\n", 6),
    ("from pkg.r import registry\nclass A:\n    registry.register(1)\n", 3),
]

NOT_REGISTRY = [
    "from pkg.registry import ModelRegistry\ndef load():\n    ModelRegistry.register_model('m', object)\n",
    "from pkg.r import register\ndef _setup():\n    register('m')\n",  # defined, never called on import
    "import torch\nclass M(torch.nn.Module):\n    def __init__(self):\n        self.register_buffer('b', None)\n",
    "from pkg.r import register\ndef main():\n    register('m')\nif __name__ == '__main__':\n    main()\n",
    "def register(x):\n    return x\nregister(1)\n",  # the module's own function, which registers nothing foreign
]


@pytest.mark.parametrize(("src", "line"), REGISTRY)
def test_import_time_registration_is_flagged(src, line):
    assert (line, hygiene.IMPORT_REGISTRY) in findings(src), findings(src)


@pytest.mark.parametrize("src", NOT_REGISTRY)
def test_registration_at_run_time_is_not_import_time(src):
    assert findings(src, hygiene.IMPORT_REGISTRY) == []


def test_declared_registration_is_accepted_but_recorded():
    src = "from pkg.registry import REGISTRY\n@REGISTRY.register_processor(object)\nclass M:\n    pass\n"
    assert findings(src) == []
    assert findings(src, accepted=True) == [(2, hygiene.IMPORT_REGISTRY)]


BROAD = [
    ("def f():\n    try:\n        return fast()\n    except Exception:\n        return slow()\n", 4),
    ("def f():\n    try:\n        return fast()\n    except:\n        pass\n    return slow()\n", 4),
    ("def f():\n    try:\n        return fast()\n    except (ValueError, BaseException) as e:\n        log(e)\n", 4),
    ("import builtins\ntry:\n    x()\nexcept builtins.Exception:\n    pass\n", 4),
    ("import contextlib\ndef f():\n    with contextlib.suppress(Exception):\n        return fast()\n", 3),
    ("from contextlib import suppress\nwith suppress(BaseException):\n    x()\n", 2),
    ("try:\n    x()\nexcept* Exception:\n    pass\n", 3),
    ("def f():\n    try:\n        fast()\n    except Exception:\n        def later():\n            raise\n", 4),
]

NOT_BROAD = [
    "def f():\n    try:\n        return fast()\n    except Exception:\n        cleanup()\n        raise\n",
    "def f():\n    try:\n        return fast()\n    except Exception as e:\n        raise RuntimeError('x') from e\n",
    "def f():\n    try:\n        return fast()\n    except (ImportError, ValueError):\n        return slow()\n",
    "try:\n    import flashinfer\nexcept ImportError:\n    flashinfer = None\n",
    "class Exception(ValueError):\n    pass\ntry:\n    x()\nexcept Exception:\n    pass\n",  # not the builtin
    "import contextlib\nwith contextlib.suppress(KeyError):\n    x()\n",
    "try:\n    x()\nfinally:\n    y()\n",
]


@pytest.mark.parametrize(("src", "line"), BROAD)
def test_broad_except_fallback_is_flagged(src, line):
    assert (line, hygiene.BROAD_EXCEPT) in findings(src), findings(src)


@pytest.mark.parametrize("src", NOT_BROAD)
def test_narrow_or_reraising_handlers_pass(src):
    assert findings(src, hygiene.BROAD_EXCEPT) == []


ENV = [
    ("import os\nif os.environ.get('FAST') == '1':\n    pass\n", 2),
    ("import os\nx = os.getenv('FAST', '0')\n", 2),
    ("import os\nx = os.environ['FAST']\n", 2),
    ("import os\nx = 'FAST' in os.environ\n", 2),
    ("from os import environ\nx = environ.get('FAST')\n", 2),
    ("from os import getenv\ndef f():\n    return getenv('FAST')\n", 3),
    ("import os\nname = 'FA' + 'ST'\nx = os.environ.get(name)\n", 3),  # computed: cannot be declared
    ("import os\nx = dict(os.environ)\n", 2),
    ("from pkg import envs\nx = envs.PKG_FAST\n", 2),
    ("import pkg.envs as envs\nx = envs.PKG_FAST\n", 2),
    ("import pkg.envs\nx = pkg.envs.PKG_FAST\n", 2),
    ("from pkg.envs import PKG_FAST\ndef f():\n    return PKG_FAST\n", 3),
]


@pytest.mark.parametrize(("src", "line"), ENV)
def test_undeclared_env_switch_is_flagged(src, line):
    assert (line, hygiene.ENV_SWITCH) in findings(src), findings(src)


def test_declared_env_switch_is_accepted_but_recorded():
    for src in ("import os\nx = os.environ.get('PKG_DECLARED')\n", "from pkg import envs\nx = envs.PKG_DECLARED\n"):
        assert findings(src) == []
        assert findings(src, accepted=True) == [(2, hygiene.ENV_SWITCH)]


def test_env_read_is_reported_once():
    assert findings("import os\nx = os.environ.get('FAST')\n") == [(2, hygiene.ENV_SWITCH)]


def test_not_env():
    assert findings("import os\nx = os.path.join('a', 'b')\nenviron = {}\ny = environ.get('X')\n") == []


def test_unparseable_file_is_a_finding():
    assert findings("def f(:\n") == [(1, hygiene.UNPARSEABLE)]


def test_finding_text_names_file_line_and_rule():
    (f,) = hygiene.check_source(PATH, "import torch.nn.functional as F\nF.silu = None\n", SCOPE)
    assert f.text().startswith(f"{PATH}:2: [monkeypatch] assigns F.silu, which belongs to imported torch.nn.functional")
