"""RMSNorm shared by the reference oracles.

Kimi K3 uses the plain weighted RMSNorm everywhere the decode path normalizes (`input_layernorm`,
`post_attention_layernorm`, the AttnRes `*_res_norm`, the MLA `q_a`/`kv_a` norms, the final norm):
y = x / sqrt(mean(x^2) + eps) * w, with eps = rms_norm_eps (vLLM 0.33.0, vllm/models/kimi_k3/nvidia/model.py).
"""

from __future__ import annotations

import torch
from torch import Tensor


def rms_norm(x: Tensor, weight: Tensor | None, eps: float, dtype: torch.dtype = torch.float32) -> Tensor:
    """RMSNorm over the last dim, computed entirely in `dtype` (any float input is upcast first)."""
    x = x.to(dtype)
    y = x * torch.rsqrt(x.square().mean(dim=-1, keepdim=True) + eps)
    return y if weight is None else y * weight.to(dtype)
