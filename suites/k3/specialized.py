"""The specialized path under test: the ops the CuTe DSL kernels replace (k3_decode/kernels), on the cell's tensors.

The numerics stage runs this as a partial implementation beside the stock one: every grid cell of a replaced op
runs through the kernel and is judged against the oracle with the same tolerances and hygiene probes as stock.
AttnRes runs the kernel at every site of the grid (before attention, after it, final), not only the site its
provider serves today, so the kernel's numerics are known wherever it may be used.
Where the kernels cannot run (no CuTe DSL, no sm_90 GPU) there is no implementation, and `not_run_reason` says why.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from harness.numerics.cells import Impl, OpCall
from k3_decode.attn_res_state import AttnResBuffers, AttnResSite
from k3_decode.config import ModelDims
from k3_decode.reference.attn_res import MixWeights

NAME = "specialized"
BACKEND = "cute-dsl"


def not_run_reason() -> str | None:
    from k3_decode.kernels.providers import not_built_reason

    return not_built_reason()


@dataclass(frozen=True)
class SpecializedAdapters:
    dims: ModelDims

    def ops(self) -> dict[str, Impl]:
        return {"attn_res": self.attn_res}

    def attn_res(self, call: OpCall) -> dict[str, Tensor]:
        from k3_decode.kernels import attn_res_op

        t, a = call.tensors, call.args
        buffers = AttnResBuffers(t["prefix"], t["blocks"], num_blocks=a["bank_blocks"])
        block_size, site_name = self.dims.attn_res_block_size, a["site"]
        if site_name.startswith("final"):
            site = AttnResSite.final(self.dims.num_layers, block_size)
        elif site_name.startswith("before"):
            site = AttnResSite.before_attention(a["layer"], block_size)
        else:
            site = AttnResSite.after_attention(a["layer"], block_size)
        weights = MixWeights(t["res_norm"], t["res_proj"], t.get("out_norm"))
        return {"out": attn_res_op.apply(buffers, site, t.get("delta"), weights, self.dims.rms_norm_eps)}
