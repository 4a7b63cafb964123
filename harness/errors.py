"""Errors a user can fix: each carries one line that names the problem and the fix."""

from __future__ import annotations


class UsageError(Exception):
    """Bad input (CLI arguments, config, key, bundle path). The CLI prints it on one line and exits 2."""


class ConfigError(UsageError):
    pass
