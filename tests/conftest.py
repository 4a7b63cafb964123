"""Shared fixtures: an isolated k3gate config folder so tests never touch the user's signing key."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _isolated_key_folder(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path_factory.mktemp("xdg")))
