"""The specialized path under test: the ops the CuTe DSL kernels replace (k3_decode/kernels), on the cell's tensors.

The numerics stage runs this as a partial implementation beside the stock one: every grid cell of a replaced op
runs through the kernel and is judged against the oracle with the same tolerances and hygiene probes as stock.
AttnRes runs the kernel at every site of the grid (before attention, after it, final), not only the site its
provider serves today, so the kernel's numerics are known wherever it may be used. The KDA decode and verify cells
run the fused KDA step kernel (f_b, conv, norms, gates, the delta rule and the gated norm in one launch) on the
cell's packed rows, state and slot table; the stock op it replaces also takes the f_b GEMM, which the cell's packed
row feeds it, so both are judged from the same inputs. The input projection cells run the projection kernel at
every batch of the grid (its provider's row limits are about speed, not correctness); the o_proj cells run the
fused o_proj + AttnRes kernel up to its 64 rows (kda_o_proj_plan.MAX_BATCH: at most half its epilogue clusters
wait, two rows each above 32) and decline larger batches with that reason (`declines`): the specialized executor
keeps o_proj stock there.
Where the kernels cannot run (no CuTe DSL, no sm_90 GPU) there is no implementation, and `not_run_reason` says why.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from harness.numerics.cells import Case, Impl, OpCall
from k3_decode.attn_res_state import AttnResBuffers, AttnResSite
from k3_decode.config import ModelDims
from k3_decode.reference import kda as ref_kda
from k3_decode.reference.attn_res import MixWeights
from suites.k3.kda import WEIGHT_NAMES as KDA_WEIGHT_NAMES

NAME = "specialized"
BACKEND = "cute-dsl"


def not_run_reason() -> str | None:
    from k3_decode.kernels.providers import not_built_reason

    return not_built_reason()


@dataclass(frozen=True)
class SpecializedAdapters:
    dims: ModelDims

    def ops(self) -> dict[str, Impl]:
        return {
            "attn_res": self.attn_res,
            "kda_decode": self.kda_decode,
            "kda_verify": self.kda_verify,
            "kda_in_proj": self.kda_in_proj,
            "kda_o_proj": self.kda_o_proj,
        }

    def declines(self, case: Case) -> str | None:
        """Why a cell of these ops is beyond the kernels (None: they take it)."""
        from k3_decode.kernels.kda_o_proj_plan import MAX_BATCH  # plain Python: no CuTe DSL needed

        rows = case.axes.get("batch", 0)
        if case.spec.op == "kda_o_proj" and rows > MAX_BATCH:
            return (
                f"the fused o_proj + AttnRes kernel serves 1..{MAX_BATCH} rows (at most half its epilogue clusters "
                f"wait, two rows each above 32), not {rows}"
            )
        return None

    def kda_in_proj(self, call: OpCall) -> dict[str, Tensor]:
        from k3_decode.kernels import kda_in_proj_op

        return {"packed": kda_in_proj_op.linear(call.tensors["x"], call.tensors["in_proj"])}

    def kda_o_proj(self, call: OpCall) -> dict[str, Tensor]:
        from k3_decode.kernels import kda_o_proj_op

        t, a = call.tensors, call.args
        buffers = AttnResBuffers(t["prefix"], t["blocks"], num_blocks=a["bank_blocks"])
        site = AttnResSite.after_attention(a["layer"], self.dims.attn_res_block_size)
        weights = MixWeights(t["res_norm"], t["res_proj"], t["out_norm"])
        attn_out, out = kda_o_proj_op.apply(t["o"], t["o_proj"], buffers, site, weights, self.dims.rms_norm_eps)
        return {"attn_out": attn_out, "out": out}

    def _kda(self, call: OpCall) -> tuple[ref_kda.KdaSpec, ref_kda.KdaWeights, ref_kda.KdaCache]:
        t = call.tensors
        weights = ref_kda.KdaWeights(**{k: t[k] for k in KDA_WEIGHT_NAMES})
        cache = ref_kda.KdaCache(conv=t["conv_state"], recurrent=t["recurrent_state"])  # updated in place
        return ref_kda.KdaSpec.for_rank(self.dims, call.args["tp"]), weights, cache

    def kda_decode(self, call: OpCall) -> dict[str, Tensor]:
        from k3_decode.kernels import kda_step_op

        spec, weights, cache = self._kda(call)
        return {"out": kda_step_op.decode_step(spec, weights, call.tensors["packed"], cache, call.tensors["slots"])}

    def kda_verify(self, call: OpCall) -> dict[str, Tensor]:
        from k3_decode.kernels import kda_step_op

        spec, weights, cache = self._kda(call)
        t = call.tensors
        return {"out": kda_step_op.verify_step(spec, weights, t["packed"], cache, t["slots"], t["num_accepted"])}

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
