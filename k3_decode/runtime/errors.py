"""Errors the runtime raises at start-up; each message is one line naming the problem and the fix."""

from __future__ import annotations


class StartupError(ValueError):
    """A deployment the runtime refuses before it builds anything.

    A ValueError, as vLLM 0.33.0 raises for an unsupported specialized decode deployment
    (vllm/models/kimi_k3/nvidia/specialized_decode/runtime), so callers that catch that keep working.
    """


class BackendError(StartupError):
    """`decode_backend` is unknown, or names a path this build cannot run."""


class ScopeError(StartupError):
    """The deployment is outside the subject's scope for the selected backend."""


class RankDisagreementError(StartupError):
    """Tensor-parallel ranks reached different scope verdicts for what must be one deployment."""


class DataFileError(ValueError):
    """A runtime data file (scope, op table) is malformed."""
