from __future__ import annotations

import pytest

from harness.isolation import scope
from harness.isolation.scope import ScopeError, for_subject, load_file, parse

GOOD = {"model": ["pkg/models/m/**"]}


@pytest.mark.parametrize(
    ("section", "message"),
    [
        (None, "has no [isolation] table"),
        ({}, "isolation.model: is missing"),
        ({"model": []}, "isolation.model: is empty"),
        ({"model": "pkg/**"}, "is not a list of globs"),
        ({**GOOD, "modle": []}, "isolation.modle: is not a key of the code scope"),
        ({"model": ["/abs/**"]}, "must be a non-empty path relative"),
        ({**GOOD, "review": {"sampling": []}}, "isolation.review.sampling: is empty"),
        ({**GOOD, "review": ["x/**"]}, "isolation.review: is not a table"),
        ({**GOOD, "env": {"X": ""}}, "isolation.env: must map each name to a non-empty reason"),
        ({**GOOD, "registrations": {"a.register": 1}}, "isolation.registrations: must map"),
        ({**GOOD, "env_modules": "pkg.envs"}, "isolation.env_modules"),
        ({**GOOD, "repository": "vllm"}, "isolation.repository: 'vllm' is not allowed"),
        ({**GOOD, "repository": "external"}, "isolation.repository_env: is missing"),
        ({**GOOD, "co_change": [{"name": "r", "when": ["a/**"], "why": "w"}]}, "co_change[0]: misses forbids"),
        (
            {**GOOD, "co_change": [{"name": "r", "when": ["a/**"], "forbids": ["b"], "why": "w", "x": 1}]},
            "co_change[0]: unknown key x",
        ),
        ({**GOOD, "co_change": [{"name": "r", "when": [], "forbids": ["b"], "why": "w"}]}, "co_change[0].when"),
    ],
)
def test_bad_scope_is_one_line_naming_key_and_fix(section, message):
    with pytest.raises(ScopeError) as exc:
        parse(section, "t.toml")
    text = str(exc.value)
    assert message in text and "\n" not in text and " — " in text


def test_subject_scopes_load():
    hopper = for_subject("k3-hopper")
    assert hopper.model == ("k3_decode/**",) and hopper.repository == scope.SELF
    assert hopper.co_change and "suites/tolerances.toml" in hopper.co_change[0].forbids
    vllm = for_subject("vllm-k3")
    assert vllm.repository == scope.EXTERNAL and vllm.repository_env == "K3GATE_VLLM_REPO"
    assert vllm.model_packages() == ("vllm.models.kimi_k3",)
    assert "vllm/v1/sample/**" in vllm.review["sampling"]


def test_unknown_subject():
    with pytest.raises(ScopeError, match="unknown subject 'k4' — use one of"):
        for_subject("k4")


def test_repository_path_of_an_external_scope(monkeypatch, tmp_path):
    s = parse({**GOOD, "repository": "external", "repository_env": "K3GATE_TEST_REPO"}, "t")
    monkeypatch.delenv("K3GATE_TEST_REPO", raising=False)
    assert s.repository_path() == (None, "set K3GATE_TEST_REPO to a git checkout of the repository this scope judges")
    monkeypatch.setenv("K3GATE_TEST_REPO", str(tmp_path))
    assert s.repository_path() == (tmp_path, "")


def test_load_file(tmp_path):
    with pytest.raises(ScopeError, match="does not exist"):
        load_file(tmp_path / "none.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[isolation\n")
    with pytest.raises(ScopeError, match="is not valid TOML"):
        load_file(bad)
    good = tmp_path / "good.toml"
    good.write_text('[isolation]\nmodel = ["m/**"]\n[isolation.env]\nX = "why"\n')
    assert load_file(good).env == {"X": "why"}


class _NoScope:
    name = "bare"


class _EmptyScope:
    name = "empty"

    def code_scope(self):
        return None


@pytest.mark.parametrize("subject", [_NoScope(), _EmptyScope()])
def test_subject_without_code_scope(monkeypatch, subject):
    monkeypatch.setattr("harness.subjects.load_subject", lambda _name: subject)
    with pytest.raises(scope.NoCodeScope, match="declares no code scope — add an \\[isolation\\] table"):
        for_subject("x")
