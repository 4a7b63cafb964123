"""Shared fixtures: an isolated k3gate config folder so tests never touch the user's signing key."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _isolated_key_folder(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path_factory.mktemp("xdg")))


def pytest_collection_modifyitems(config, items):
    """GPU tests run on the accelerator machine; elsewhere they are skipped with that reason, never passed."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run `pytest -m gpu` on the accelerator machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
