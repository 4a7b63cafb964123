"""Start-up scope checks in the spirit of vLLM 0.33.0's unsupported(), and agreement of verdicts across ranks.

Each check looks at one property of the deployment and, when it is out of scope, returns the reason and the fix. The
scope file lists which checks apply to each backend and in which order; the first failure is the verdict, as in
vLLM 0.33.0 (vllm/models/kimi_k3/nvidia/specialized_decode/runtime), where unsupported() stops at the first reason.
Limits (TP sizes, batch, q, dtypes, graph modes, GPU families) all come from the scope file.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from k3_decode.runtime.backend import CONFIG_KEY, DecodeBackend
from k3_decode.runtime.errors import RankDisagreementError, ScopeError
from k3_decode.runtime.scopefile import RuntimeScope

Device = Literal["cpu", "cuda"]
# vLLM's CUDAGraphMode members, lower case: a deployment names one of these.
CUDAGRAPH_MODES = ("none", "piecewise", "full", "full_decode_only", "full_and_piecewise")
_STOCK_FIX = f"or use {CONFIG_KEY} 'auto' for the stock path"


@dataclass(frozen=True, kw_only=True)
class Deployment:
    """What the executor is about to serve, as far as the scope checks care. Every field is explicit: a default
    dtype or graph mode would let a deployment pass a check it never answered."""

    model: str
    device: Device
    capability: tuple[int, int] | None  # CUDA compute capability (major, minor); None on the CPU
    tp: int
    dcp: int
    max_batch: int  # most requests one decode step carries (vLLM max_num_seqs)
    num_speculative_tokens: int  # 0 without speculative decoding
    spec_method: str | None
    mla_cache_dtype: str
    kda_conv_state_dtype: str
    kda_recurrent_state_dtype: str
    cudagraph_mode: str
    capture_sizes: tuple[int, ...]  # CUDA-graph capture sizes in rows (vLLM cudagraph_capture_sizes)
    # Whether the TP all-reduces run: True on a multi-GPU deployment, False where one rank's shard runs alone and
    # they are the identity (the executor's per-rank shapes on one GPU). A provider that fuses past a row-parallel
    # output (o_proj with the AttnRes after it) serves only the second kind until its fused all-reduce exists.
    tp_all_reduce: bool

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"deployment device {self.device!r} is not 'cpu' or 'cuda'; pass one of them")
        if (self.device == "cuda") != (self.capability is not None):
            raise ValueError("deployment capability must be (major, minor) on 'cuda' and None on 'cpu'; fix one")
        for name in ("tp", "dcp", "max_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"deployment {name} must be >= 1, got {getattr(self, name)}")
        if self.num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {self.num_speculative_tokens}")
        if (self.num_speculative_tokens > 0) != (self.spec_method is not None):
            raise ValueError(
                "spec_method and num_speculative_tokens disagree: name a method exactly when speculative tokens > 0"
            )
        if self.cudagraph_mode not in CUDAGRAPH_MODES:
            raise ValueError(f"cudagraph_mode {self.cudagraph_mode!r} is not one of {', '.join(CUDAGRAPH_MODES)}")
        if any(c < 1 for c in self.capture_sizes):
            raise ValueError(f"capture_sizes must be positive, got {list(self.capture_sizes)}")

    @property
    def tokens_per_request(self) -> int:
        """q: the tokens of one request in a decode (1) or verify (1 + speculative tokens) step."""
        return 1 + self.num_speculative_tokens


def local_device() -> tuple[Device, tuple[int, int] | None]:
    """This process's device as the scope checks see it: the current CUDA device and its capability, or the CPU."""
    import torch  # only here: the checks themselves need no torch

    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return "cuda", (major, minor)
    return "cpu", None


@dataclass(frozen=True)
class Failure:
    reason: str  # completes "... does not support <reason>"
    fix: str


Check = Callable[[Deployment, RuntimeScope], Failure | None]


def _listed(values: Iterable[object]) -> str:
    return ", ".join(str(v) for v in values)


def _model(d: Deployment, s: RuntimeScope) -> Failure | None:
    if d.model in s.models:
        return None
    return Failure(f"model {d.model!r} (scope {s.subject} covers {_listed(s.models)})", f"use {_listed(s.models)}")


def _cpu_model(d: Deployment, s: RuntimeScope) -> Failure | None:
    if d.device != "cpu" or d.model in s.cpu_models:
        return None
    fix = f"use model {_listed(s.cpu_models)} on the CPU or run on a GPU" if s.cpu_models else "run on a GPU"
    return Failure(f"model {d.model!r} on the CPU (too large for it)", fix)


def _device(d: Deployment, s: RuntimeScope) -> Failure | None:
    families = _listed(f"sm_{f}" for f in s.specialized_sm_families)
    fix = f"run on a GPU of the {families} family {_STOCK_FIX}"
    if d.capability is None:
        return Failure(f"the CPU (the specialized kernels need a {families} GPU)", fix)
    major, minor = d.capability
    if major * 10 in s.specialized_sm_families:
        return None
    return Failure(f"this GPU (sm_{major}{minor}; the specialized kernels are built for {families})", fix)


def _tp(d: Deployment, s: RuntimeScope) -> Failure | None:
    if d.tp in s.tp:
        return None
    return Failure(f"TP={d.tp} (scope {s.subject} allows TP {_listed(s.tp)})", f"use TP {_listed(s.tp)}")


def _dcp(d: Deployment, s: RuntimeScope) -> Failure | None:
    allowed = s.allowed_dcp(d.tp)
    if d.dcp in allowed:
        return None
    return Failure(
        f"DCP={d.dcp} at TP={d.tp} (decode context parallel must be 1 or TP)", f"set DCP to {_listed(allowed)}"
    )


def _batch(d: Deployment, s: RuntimeScope) -> Failure | None:
    if d.max_batch <= s.max_batch:
        return None
    return Failure(
        f"batches of {d.max_batch} requests (the specialized path prepares at most {s.max_batch})",
        f"cap the batch (max_num_seqs) at {s.max_batch} {_STOCK_FIX}",
    )


def _tokens_per_request(d: Deployment, s: RuntimeScope) -> Failure | None:
    q, top = d.tokens_per_request, s.max_tokens_per_request
    if q <= top:
        return None
    return Failure(
        f"{q} tokens per request ({d.num_speculative_tokens} speculative; at most {top})",
        f"use at most {top - 1} speculative tokens",
    )


def _spec_method(d: Deployment, s: RuntimeScope) -> Failure | None:
    if d.spec_method is None or d.spec_method in s.spec_methods:
        return None
    return Failure(
        f"speculative method {d.spec_method!r} (the verify kernels need uniform q, as {_listed(s.spec_methods)} give)",
        f"use spec method {_listed(s.spec_methods)} or no speculative decoding",
    )


def _kda_state_dtypes(d: Deployment, s: RuntimeScope) -> Failure | None:
    got = (d.kda_conv_state_dtype, d.kda_recurrent_state_dtype)
    want = (s.kda_conv_state_dtype, s.kda_recurrent_state_dtype)
    if got == want:
        return None
    return Failure(
        f"KDA cache dtypes conv {got[0]}, recurrent {got[1]} (the kernels update conv {want[0]}, "
        f"recurrent {want[1]} in place)",
        f"set the KDA state dtypes to conv {want[0]}, recurrent {want[1]}",
    )


def _mla_cache_dtype(d: Deployment, s: RuntimeScope) -> Failure | None:
    if d.mla_cache_dtype == s.mla_cache_dtype:
        return None
    return Failure(
        f"MLA cache dtype {d.mla_cache_dtype} (the kernels read and insert {s.mla_cache_dtype})",
        f"set the MLA cache dtype to {s.mla_cache_dtype}",
    )


def _cudagraph_mode(d: Deployment, s: RuntimeScope) -> Failure | None:
    if d.cudagraph_mode in s.specialized_cudagraph_modes:
        return None
    return Failure(
        f"CUDA-graph mode {d.cudagraph_mode!r} (deployments without FULL decode CUDA graphs)",
        f"set the CUDA-graph mode to {_listed(s.specialized_cudagraph_modes)}",
    )


CHECKS: dict[str, Check] = {
    "model": _model,
    "cpu_model": _cpu_model,
    "device": _device,
    "tp": _tp,
    "dcp": _dcp,
    "batch": _batch,
    "tokens_per_request": _tokens_per_request,
    "spec_method": _spec_method,
    "kda_state_dtypes": _kda_state_dtypes,
    "mla_cache_dtype": _mla_cache_dtype,
    "cudagraph_mode": _cudagraph_mode,
}


@dataclass(frozen=True)
class ScopeVerdict:
    """One rank's answer: accepted (check is None) or the first failed check with its reason and fix."""

    subject: str
    backend: DecodeBackend
    check: str | None = None
    reason: str = ""
    fix: str = ""

    @property
    def ok(self) -> bool:
        return self.check is None

    def message(self) -> str:
        if self.ok:
            return f"{self.subject}: {CONFIG_KEY} {self.backend!r} accepted"
        return f"{self.subject}: {CONFIG_KEY} {self.backend!r} does not support {self.reason}; {self.fix}"

    def raise_if_rejected(self) -> None:
        if not self.ok:
            raise ScopeError(self.message())


def scope_verdict(deployment: Deployment, scope: RuntimeScope, backend: DecodeBackend) -> ScopeVerdict:
    names = scope.specialized_checks if backend == "latency_specialized" else scope.stock_checks
    for name in names:
        if failure := CHECKS[name](deployment, scope):
            return ScopeVerdict(scope.subject, backend, name, failure.reason, failure.fix)
    return ScopeVerdict(scope.subject, backend)


def check_scope(deployment: Deployment, scope: RuntimeScope, backend: DecodeBackend) -> ScopeVerdict:
    """The verdict, raising ScopeError with its one-line message when the deployment is out of scope."""
    verdict = scope_verdict(deployment, scope, backend)
    verdict.raise_if_rejected()
    return verdict


def _ranks(ranks: list[int]) -> str:
    """Compact rank lists: [0, 1, 2, 5] -> "ranks 0-2, 5"."""
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    text = ", ".join(f"{run[0]}-{run[-1]}" if len(run) > 2 else ", ".join(map(str, run)) for run in runs)
    return f"{'rank' if len(ranks) == 1 else 'ranks'} {text}"


def agreed_verdict(verdicts: Sequence[ScopeVerdict], tp: int | None = None) -> ScopeVerdict:
    """The verdict every TP rank reached (verdicts[r] is rank r's), or one error naming the ranks that differ.

    vLLM 0.33.0's NVIDIA K3 path does no such agreement (its AMD path and DSv4.1 do), so a rank that alone fell
    back would deadlock the others in the specialized all-reduces. The multi-GPU executor gathers the verdicts.
    """
    if not verdicts:
        raise ValueError("agreed_verdict needs one verdict per rank, got none")
    if tp is not None and len(verdicts) != tp:
        raise ValueError(f"expected a scope verdict from each of the {tp} TP ranks, got {len(verdicts)}")
    groups: dict[ScopeVerdict, list[int]] = {}
    for rank, verdict in enumerate(verdicts):
        groups.setdefault(verdict, []).append(rank)
    if len(groups) == 1:
        return verdicts[0]
    parts = [
        f"{_ranks(ranks)} {'accept' if v.ok else 'reject: ' + v.reason} ({CONFIG_KEY} {v.backend!r})"
        for v, ranks in groups.items()
    ]
    raise RankDisagreementError(
        "TP ranks disagree on the scope verdict: " + "; ".join(parts) + "; give every rank the same deployment"
    )
