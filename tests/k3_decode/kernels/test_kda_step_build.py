"""The fused KDA decode step kernel's plan and builds: what is built (fast, no CuTe DSL), and real sm_90a builds of
one shape per cluster size with their PTX, SASS and cubin checked, a wrong expectation and two broken kernels that
must fail (slow; needs CuTe DSL, `pip install 'k3gate[cutedsl]'`). `k3gate kernels build --arch sm_90a --match
'kda_step*'` compiles all twenty-five."""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import json
import re

import pytest

from harness.kernels_cmd import cubin_resources, judge, parse_expectations, select_builds
from k3_decode.config import K3
from k3_decode.kernels import kda_step_plan
from k3_decode.kernels.attn_res_plan import AttnResKind
from k3_decode.kernels.builds import K3_KERNEL_BUILDS, K3KernelBuilds, KdaStepBuild
from k3_decode.kernels.kda_o_proj_plan import MAX_BATCH as O_PROJ_MAX_BATCH
from k3_decode.kernels.kda_o_proj_plan import OProjPlan
from k3_decode.kernels.kda_step_plan import (
    CLUSTERS,
    CONV_WIDTH,
    GATE_RANK,
    HEAD_DIM,
    RESIDENT_THREADS,
    KdaStepPlan,
    KdaVerifyPlan,
    StepVariant,
    knob_alone,
    the_pair,
)
from k3_decode.reference.kda import KdaSpec
from tests.k3_decode.kernels.helpers import (
    assert_launch_reaches_the_driver,
    build_command,
    failed_checks_of_broken_build,
    needs_cutedsl,
    sm90_ptx,
)

SMEM_PER_SM = 228 * 1024  # an H100/H200 SM's shared memory; the driver reserves 1 KiB per CTA
STATIC_SMEM = 1024  # the static shared memory every build's cubin records beside the plan's dynamic bytes
H200_SMS = 132
# The cluster the plan picks per (TP, batch): 8 CTAs per head while the grid would leave SMs idle, fewer above.
CLUSTER = {
    (8, 1): 8, (8, 2): 8, (8, 4): 4, (8, 8): 2, (8, 16): 2, (8, 64): 2,
    (16, 1): 8, (16, 2): 8, (16, 4): 8, (16, 8): 4, (16, 16): 2, (16, 64): 2,
}  # fmt: skip


def step_builds() -> list[KdaStepBuild]:
    return [b for b in K3_KERNEL_BUILDS.builds("sm_90a") if isinstance(b, KdaStepBuild)]


# --- the plan -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tp", [8, 16])
def test_the_plan_reads_the_packed_row_the_model_writes(tp):
    shard = K3.shard(tp)
    plan = KdaStepPlan.for_shape(shard.kda_heads, shard.kda_in_proj_rows, 1)
    sections = {name: s.start for name, s in shard.in_proj_sections().items() if name != "pad"}
    assert plan.sections == sections
    assert plan.unpadded_rows == shard.kda_in_proj_unpadded and plan.rows == shard.kda_in_proj_rows
    assert plan.proj == shard.kda_proj and plan.conv_channels == shard.kda_conv_state[0]
    spec = KdaSpec.for_rank(K3, tp)  # what the launcher checks the plan against
    assert (spec.head_dim, spec.gate_rank, spec.conv_width) == (HEAD_DIM, 128, 4)


@pytest.mark.parametrize("cluster", CLUSTERS)
def test_a_cluster_covers_a_head_and_fits_an_sm(cluster):
    plan = KdaStepPlan(12, 6288, 4, cluster)
    rows = plan.rows_per_cta
    assert rows * cluster == HEAD_DIM and plan.warps * 4 == rows and plan.threads == 32 * plan.warps
    assert plan.slots == 32  # one norm partial per lane of the final sum
    assert plan.qk_lanes_per_cta * cluster == 16 and 1 <= plan.v_lanes <= 32  # each tap rewritten by one CTA
    # The decays: every CTA receives 128 floats, 8 bytes per (source CTA, warp, f_b row pair).
    assert cluster * plan.warps * 2 * 8 == HEAD_DIM * 4
    # 32 warps per SM whatever the cluster: registers (64 each) and shared memory both allow it.
    assert plan.threads * plan.ctas_per_sm == RESIDENT_THREADS
    assert plan.ctas_per_sm * 64 * plan.threads <= 65536
    assert plan.ctas_per_sm * (plan.smem_bytes + STATIC_SMEM + 1024) <= SMEM_PER_SM
    # Bulk copies move whole 16-byte units into 16-byte aligned places.
    for size in (plan.weight_bytes, plan.packed_bytes, plan.tap_bytes, plan.state_bytes, rows * 2, rows * 6):
        assert size % 16 == 0, size
    assert plan.state_bytes == rows * HEAD_DIM * 4 and plan.conv_local == 2 * HEAD_DIM + rows


def test_the_cluster_fills_the_gpu_until_the_batch_does():
    for (tp, batch), cluster in CLUSTER.items():
        shard = K3.shard(tp)
        plan = KdaStepPlan.for_shape(shard.kda_heads, shard.kda_in_proj_rows, batch, H200_SMS)
        assert plan.cluster == cluster, (tp, batch)
        assert plan.ctas >= H200_SMS or cluster == max(CLUSTERS), (tp, batch)
        smaller = [c for c in CLUSTERS if c < cluster]
        assert all(shard.kda_heads * batch * c < H200_SMS for c in smaller), (tp, batch)


def test_a_cluster_asked_for_overrides_the_choice_and_is_checked():
    """The GPU test times every cluster through this override; a cluster the kernel cannot run is refused."""
    for cluster in CLUSTERS:
        plan = KdaStepPlan.for_shape(12, 6288, 8, H200_SMS, cluster=cluster)
        assert (plan.cluster, plan.ctas) == (cluster, 12 * 8 * cluster)
    with pytest.raises(ValueError, match="cluster of"):
        KdaStepPlan.for_shape(12, 6288, 8, H200_SMS, cluster=1)


def test_the_register_budget_sets_the_ctas_an_sm_holds():
    for cluster, threads in ((8, 128), (4, 256), (2, 512)):
        narrow = KdaStepPlan(12, 6288, 64, cluster)
        wide = KdaStepPlan(12, 6288, 64, cluster, resident_threads=1536)
        assert (narrow.ctas_per_sm, wide.ctas_per_sm) == (1024 // threads, 1536 // threads)
        assert narrow.tag == f"h12/b64/c{cluster}" and wide.tag == f"h12/b64/c{cluster}/t1536"
    with pytest.raises(ValueError, match="threads per SM"):
        KdaStepPlan(12, 6288, 64, 2, resident_threads=2048)  # 32 registers: the build spills


def test_warming_reaches_one_wave_ahead_and_is_refused_where_there_is_none():
    """A warming CTA prefetches the state of the CTA that takes its place: wave_requests requests later, the
    requests whose CTAs fill every SM at ctas_per_sm. One wave of CTAs has no later one to warm."""
    cases = {(12, 64, 1024): 11, (12, 64, 1536): 16, (12, 32, 1536): 16, (6, 64, 1024): 22, (6, 64, 1536): 33}
    for (heads, batch, threads), ahead in cases.items():
        rows = 6288 if heads == 12 else 3216
        plan = KdaStepPlan.for_shape(
            heads, rows, batch, H200_SMS, resident_threads=threads, **knob_alone(lean_start=False)
        )
        warm = dataclasses.replace(plan, warm_ahead=True)
        assert (plan.ahead, warm.ahead, warm.wave_requests) == (0, ahead, ahead), (heads, batch, threads)
        # the CTAs of `ahead` requests are exactly what the SMs hold at once, one more request's would not fit
        assert ahead * warm.cluster * heads <= H200_SMS * warm.ctas_per_sm < (ahead + 1) * warm.cluster * heads
        assert warm.tag == plan.tag + "/warm" and warm.smem_bytes == plan.smem_bytes
    with pytest.raises(ValueError, match="one wave"):
        KdaStepPlan.for_shape(12, 6288, 8, H200_SMS, warm_ahead=True)  # 192 CTAs: all resident at once
    with pytest.raises(ValueError, match="one wave"):
        KdaStepPlan.for_shape(6, 3216, 32, H200_SMS, resident_threads=1536, warm_ahead=True)  # 33 requests a wave


def _choice_file(tmp_path, rules: str, default: str = "{ resident_threads = 1024, warm_ahead = false }"):
    tmp_path.mkdir(exist_ok=True)
    path = tmp_path / "kda_step_choice.toml"
    path.write_text(f"default = {default}\nrules = [{rules}]\n")
    return path


def test_the_plan_takes_the_variant_the_choice_file_serves(tmp_path, monkeypatch):
    """for_shape takes its budget and warming from kda_step_choice.toml: the first rule whose heads and batches
    match, else the default; a rule's warming applies where the grid has a next wave; an argument overrides."""
    rules = (
        "{ heads = 12, batches = [32, 64], resident_threads = 1536, warm_ahead = true }, "
        "{ batches = [8, 64], resident_threads = 1024, warm_ahead = true }"
    )
    path = _choice_file(tmp_path, rules)
    monkeypatch.setattr(kda_step_plan, "CHOICE", path)
    tags = {
        (h, b): KdaStepPlan.for_shape(h, 6288 if h == 12 else 3216, b, H200_SMS).tag
        for h in (12, 6)
        for b in (4, 8, 16, 32, 64)
    }
    assert tags == {
        (12, 4): "h12/b4/c4", (12, 8): "h12/b8/c2", (12, 16): "h12/b16/c2/warm",  # B8: one wave, nothing to warm
        (12, 32): "h12/b32/c2/t1536/warm", (12, 64): "h12/b64/c2/t1536/warm",
        (6, 4): "h6/b4/c8", (6, 8): "h6/b8/c4", (6, 16): "h6/b16/c2",
        (6, 32): "h6/b32/c2/warm", (6, 64): "h6/b64/c2/warm",
    }  # fmt: skip
    plan = KdaStepPlan.for_shape(12, 6288, 64, H200_SMS, resident_threads=1024, warm_ahead=False)
    assert plan.tag == "h12/b64/c2"
    # a group rule: two requests a cluster where the batch divides into pairs, one where it does not
    group = "{ batches = [16, 64], resident_threads = 1024, warm_ahead = false, requests_per_cta = 2 }"
    path = _choice_file(tmp_path / "groups", group)  # its own file: the table is read once per path
    monkeypatch.setattr(kda_step_plan, "CHOICE", path)
    assert [KdaStepPlan.for_shape(12, 6288, b, H200_SMS).tag for b in (8, 16, 17, 64)] == [
        "h12/b8/c2", "h12/b16/c2/r2", "h12/b17/c2", "h12/b64/c2/r2"
    ]  # fmt: skip
    # a local-decays rule, and an argument turning it off
    local = "{ batches = [1, 8], resident_threads = 1024, warm_ahead = false, local_decays = true }"
    monkeypatch.setattr(kda_step_plan, "CHOICE", _choice_file(tmp_path / "local", local))
    assert [KdaStepPlan.for_shape(6, 3216, b, H200_SMS).tag for b in (1, 8, 16)] == [
        "h6/b1/c8/local-decays", "h6/b8/c4/local-decays", "h6/b16/c2"
    ]  # fmt: skip
    assert KdaStepPlan.for_shape(6, 3216, 1, H200_SMS, local_decays=False).tag == "h6/b1/c8"
    # a lean-start rule, and an argument turning it off
    lean = "{ batches = [16, 64], resident_threads = 1536, warm_ahead = false, lean_start = true }"
    monkeypatch.setattr(kda_step_plan, "CHOICE", _choice_file(tmp_path / "lean", lean))
    assert [KdaStepPlan.for_shape(12, 6288, b, H200_SMS).tag for b in (8, 16, 64)] == [
        "h12/b8/c2", "h12/b16/c2/t1536/lean", "h12/b64/c2/t1536/lean"
    ]  # fmt: skip
    assert KdaStepPlan.for_shape(12, 6288, 64, H200_SMS, lean_start=False).tag == "h12/b64/c2/t1536"
    # a lean-conv rule beside it
    conv = "{ batches = [1, 64], resident_threads = 1024, warm_ahead = false, lean_conv = true }"
    monkeypatch.setattr(kda_step_plan, "CHOICE", _choice_file(tmp_path / "conv", conv))
    assert KdaStepPlan.for_shape(6, 3216, 1, H200_SMS).tag == "h6/b1/c8/lean-conv"
    assert KdaStepPlan.for_shape(6, 3216, 1, H200_SMS, lean_conv=False).tag == "h6/b1/c8"
    # a joint-sums rule
    joint = "{ batches = [16, 64], resident_threads = 1536, warm_ahead = false, joint_sums = true }"
    monkeypatch.setattr(kda_step_plan, "CHOICE", _choice_file(tmp_path / "joint", joint))
    assert KdaStepPlan.for_shape(12, 6288, 64, H200_SMS).tag == "h12/b64/c2/t1536/joint-sums"
    assert KdaStepPlan.for_shape(12, 6288, 64, H200_SMS, joint_sums=False).tag == "h12/b64/c2/t1536"
    # a capped rule: the cap applies only where it binds (TP8 B16's 384 CTAs already put three on an SM)
    cap = "{ batches = [16, 64], resident_threads = 1024, warm_ahead = false, wide_warps = true, max_ctas_per_sm = 3 }"
    monkeypatch.setattr(kda_step_plan, "CHOICE", _choice_file(tmp_path / "cap", cap))
    assert [KdaStepPlan.for_shape(12, 6288, b, H200_SMS).tag for b in (16, 32)] == [
        "h12/b16/c2/wide-warps", "h12/b32/c2/wide-warps/cap3"
    ]  # fmt: skip
    assert KdaStepPlan.for_shape(12, 6288, 32, H200_SMS, max_ctas_per_sm=0).tag == "h12/b32/c2/wide-warps"
    assert KdaStepPlan.for_shape(12, 6288, 32, H200_SMS, **knob_alone()).tag == "h12/b32/c2"
    # the shipped file: the variant every measurement so far ran, at every batch
    monkeypatch.undo()
    default, shipped = kda_step_plan.variant_rules()
    assert default == kda_step_plan.StepVariant(RESIDENT_THREADS, False)
    assert all(r.first <= r.last for r in shipped)


BAD_CHOICES = {
    "resident_threads = 2048": ("{ batches = [1, 2], resident_threads = 2048, warm_ahead = false }", "one of"),
    "a batch range backwards": ("{ batches = [8, 4], resident_threads = 1024, warm_ahead = false }", "not a range"),
    "no batches": ("{ resident_threads = 1024, warm_ahead = false }", "batches is"),
    "an unknown key": ("{ batches = [1, 2], resident_threads = 1024, warm_ahead = false, c = 2 }", "must name"),
    "a string for warm_ahead": ("{ batches = [1, 2], resident_threads = 1024, warm_ahead = 'yes' }", "true or false"),
    "three requests a cluster": (
        "{ batches = [1, 2], resident_threads = 1024, warm_ahead = false, requests_per_cta = 3 }",
        "requests_per_cta one of",
    ),
    "a warmed group": (
        "{ batches = [1, 2], resident_threads = 1024, warm_ahead = true, requests_per_cta = 2 }",
        "not built together",
    ),
    "a string for local_decays": (
        "{ batches = [1, 2], resident_threads = 1024, warm_ahead = false, local_decays = 'yes' }",
        "local_decays is true or false",
    ),
    "a string for lean_start": (
        "{ batches = [1, 2], resident_threads = 1024, warm_ahead = false, lean_start = 1 }",
        "lean_start is true or false",
    ),
    "a group with a lean start": (
        "{ batches = [2, 4], resident_threads = 1024, warm_ahead = false, requests_per_cta = 2, lean_start = true }",
        "lean_start and requests_per_cta > 1 are not built together",
    ),
    "a string for lean_conv": (
        "{ batches = [1, 2], resident_threads = 1024, warm_ahead = false, lean_conv = 'yes' }",
        "lean_conv is true or false",
    ),
    "a group with a lean conv": (
        "{ batches = [2, 4], resident_threads = 1024, warm_ahead = false, requests_per_cta = 2, lean_conv = true }",
        "lean_conv and requests_per_cta > 1 are not built together",
    ),
    "a string for joint_sums": (
        "{ batches = [1, 2], resident_threads = 1024, warm_ahead = false, joint_sums = 1 }",
        "joint_sums is true or false",
    ),
    "a group with joint sums": (
        "{ batches = [2, 4], resident_threads = 1024, warm_ahead = false, requests_per_cta = 2, joint_sums = true }",
        "joint_sums and requests_per_cta > 1 are not built together",
    ),
    "a string for wide_warps": (
        "{ batches = [1, 2], resident_threads = 1024, warm_ahead = false, wide_warps = 'on' }",
        "wide_warps is true or false",
    ),
    "a group with wide warps": (
        "{ batches = [2, 4], resident_threads = 1024, warm_ahead = false, requests_per_cta = 2, wide_warps = true }",
        "wide_warps and requests_per_cta > 1 are not built together",
    ),
    "wide warps with joint sums": (
        "{ batches = [2, 4], resident_threads = 1024, warm_ahead = false, joint_sums = true, wide_warps = true }",
        "wide_warps and joint_sums are not built together",
    ),
    "a cap of no CTAs": (
        "{ batches = [1, 2], resident_threads = 1024, warm_ahead = false, max_ctas_per_sm = 0 }",
        "max_ctas_per_sm is a positive count",
    ),
    "a cap that is not a count": (
        "{ batches = [1, 2], resident_threads = 1024, warm_ahead = false, max_ctas_per_sm = true }",
        "max_ctas_per_sm is a positive count",
    ),
    "a group with local decays": (
        "{ batches = [2, 4], resident_threads = 1024, warm_ahead = false, requests_per_cta = 2, local_decays = true }",
        "local_decays and requests_per_cta > 1 are not built together",
    ),
}


@pytest.mark.parametrize("bad", sorted(BAD_CHOICES))
def test_a_malformed_choice_file_is_an_error_naming_it(tmp_path, bad):
    rules, message = BAD_CHOICES[bad]
    with pytest.raises(ValueError, match=rf"kda_step_choice\.toml rules\[0\].*{message}"):
        kda_step_plan.variant_rules(_choice_file(tmp_path, rules))


def test_every_knob_of_a_variant_is_a_key_the_choice_file_takes(tmp_path):
    """A rule naming every StepVariant field, each at a value other than its default, reads back as that variant:
    a knob added to StepVariant but not to the file's grammar fails here, not when a session first serves it."""
    knobs = {"requests_per_cta": 2, "max_ctas_per_sm": 3}
    knobs |= {f.name: True for f in dataclasses.fields(StepVariant) if isinstance(f.default, bool)}
    knobs |= {"warm_ahead": False, "resident_threads": 1536}
    rule = "{ batches = [2, 4], " + ", ".join(f"{k} = {str(v).lower()}" for k, v in knobs.items()) + " }"
    entry = {f.name for f in dataclasses.fields(StepVariant)}
    assert set(knobs) == entry, "the rule above names every field of StepVariant"
    # the values need not make a buildable plan: the grammar reads each key, then refuses the combination
    with pytest.raises(ValueError, match=r"rules\[0\]: .* not built together"):
        kda_step_plan.variant_rules(_choice_file(tmp_path, rule))
    for name in sorted(entry - {"resident_threads", "warm_ahead", "requests_per_cta"}):
        value = str(knobs[name]).lower()
        rule = f"{{ batches = [2, 4], resident_threads = 1024, warm_ahead = false, {name} = {value} }}"
        _, (read,) = kda_step_plan.variant_rules(_choice_file(tmp_path / name, rule))
        assert getattr(read.variant, name) == knobs[name], name


def test_a_default_with_a_batch_range_or_a_missing_table_is_an_error(tmp_path):
    default = "{ batches = [1, 8], resident_threads = 1024, warm_ahead = false }"
    with pytest.raises(ValueError, match=r"kda_step_choice\.toml default must name .* nothing else"):
        kda_step_plan.variant_rules(_choice_file(tmp_path, "", default))
    path = tmp_path / "kda_step_choice.toml"
    path.write_text("default = { resident_threads = 1024, warm_ahead = false }\n")
    with pytest.raises(ValueError, match="holds `default` and `rules`"):
        kda_step_plan.variant_rules(path)


def test_a_cluster_serving_two_requests_holds_both_and_is_refused_where_it_cannot():
    """A group of 2 requests per cluster: the grid's slowest dimension halves, each CTA holds both requests' state
    rows, copies, exchanges and barriers (the weights once), and 2 CTAs of 512 threads still fit an SM at C = 2. An
    odd batch cannot be grouped, nor a group warmed; a served rule applies only where the batch divides."""
    one = KdaStepPlan.for_shape(12, 6288, 64, H200_SMS, resident_threads=1024, **knob_alone(lean_start=False))
    two = KdaStepPlan.for_shape(12, 6288, 64, H200_SMS, resident_threads=1024, requests_per_cta=2)
    assert (two.cluster, two.groups, two.ctas, two.tag) == (2, 32, one.ctas // 2, "h12/b64/c2/r2")
    # the second request's areas, each 128-byte aligned (its six barriers share the first's 128 bytes)
    areas = (one.state_bytes, one.packed_bytes, one.tap_bytes, 128 * 4, 256 * 4, one.rows_per_cta * 4, 32 * 4)
    assert two.smem_bytes - one.smem_bytes == sum(-(-n // 128) * 128 for n in areas)
    assert two.resident_ctas == two.ctas_per_sm == 2 and two.wave_requests == 2 * one.wave_requests
    with pytest.raises(ValueError, match="whole number of groups"):
        KdaStepPlan.for_shape(12, 6288, 3, H200_SMS, requests_per_cta=2)
    with pytest.raises(ValueError, match="not built together"):
        KdaStepPlan.for_shape(12, 6288, 64, H200_SMS, warm_ahead=True, requests_per_cta=2)
    with pytest.raises(ValueError, match="serves"):
        KdaStepPlan(12, 6288, 64, 2, requests_per_cta=4)


def test_a_cap_holds_an_sm_to_fewer_ctas_and_is_refused_where_it_changes_nothing():
    """max_ctas_per_sm: a grid of several waves held to fewer CTAs an SM than the register budget fits, by the
    launch's shared-memory request alone (whatever the driver charges a CTA beside it); the waves shrink with it,
    and the plan is otherwise the uncapped one. A cap at or above the budget's count, or at or above what the grid
    puts on an SM anyway, would change nothing under another name: refused."""
    for heads, rows, batch in ((12, 6288, 32), (12, 6288, 64), (6, 3216, 64)):
        free = KdaStepPlan.for_shape(heads, rows, batch, H200_SMS, **the_pair())
        capped = dataclasses.replace(free, max_ctas_per_sm=3)
        assert (free.ctas_per_sm, free.spread, free.resident_ctas, capped.spread, capped.resident_ctas) == (
            4,
            4,
            4,
            3,
            3,
        )
        # four fit at the driver's 1 KiB a CTA (the wide plans' GPU test); three padded, whatever the driver charges
        assert SMEM_PER_SM // (free.launch_smem_bytes + 1024) == 4
        for overhead in (0, 1024, 1024 + STATIC_SMEM):
            assert min(4, SMEM_PER_SM // (capped.launch_smem_bytes + overhead)) == 3, overhead
        assert capped.wave_requests == 3 * free.wave_requests // 4 and capped.smem_bytes == free.smem_bytes
        assert dataclasses.replace(capped, max_ctas_per_sm=0) == free and capped.tag == free.tag + "/cap3"
        assert (
            capped.choice["max_ctas_per_sm"] == 3
            and KdaStepPlan.for_shape(heads, rows, batch, **capped.choice) == capped
        )
    with pytest.raises(ValueError, match="below the 4 of 256 threads"):
        KdaStepPlan.for_shape(12, 6288, 32, H200_SMS, **the_pair(max_ctas_per_sm=4))
    with pytest.raises(ValueError, match="changes nothing: the grid's 384 CTAs put at most 3"):
        KdaStepPlan.for_shape(12, 6288, 16, H200_SMS, **the_pair(max_ctas_per_sm=3))
    with pytest.raises(ValueError, match="below the 3 of 512 threads"):  # the four-row plan at 1536 threads
        KdaStepPlan.for_shape(12, 6288, 32, H200_SMS, resident_threads=1536, **knob_alone(max_ctas_per_sm=3))


@pytest.mark.parametrize("tp, batch", [(8, 1), (8, 4), (8, 8), (16, 8)])
def test_local_decays_copy_the_heads_f_b_rows_and_dt_bias_and_keep_the_launch(tp, batch):
    """With local decays every CTA copies its head's 128 f_b rows (R before) and 128 dt_bias values (two plain loads
    a lane before) with the weights, and nothing else changes: the cluster, the threads, and where the grid is
    spread the launch's request, which o_proj's CTAs beside it are sized for. A group of requests cannot take it."""
    shard = K3.shard(tp)
    at = (shard.kda_heads, shard.kda_in_proj_rows, batch, H200_SMS)
    plan = KdaStepPlan.for_shape(*at, **knob_alone(local_decays=False))  # four-row warps where the pair is served
    local = KdaStepPlan.for_shape(*at, **knob_alone(local_decays=True))
    rows = plan.rows_per_cta
    assert (local.decay_rows, plan.decay_rows) == (HEAD_DIM, rows)
    assert local.weight_bytes - plan.weight_bytes == (HEAD_DIM - rows) * GATE_RANK * 2 + HEAD_DIM * 4
    # f_b and conv weights are one area (each size a multiple of 128 bytes here), dt_bias its own
    assert local.smem_bytes - plan.smem_bytes == (HEAD_DIM - rows) * GATE_RANK * 2 + HEAD_DIM * 4
    assert (local.cluster, local.threads, local.ctas_per_sm, local.spread) == (
        plan.cluster, plan.threads, plan.ctas_per_sm, plan.spread
    )  # fmt: skip
    assert local.launch_smem_bytes == plan.launch_smem_bytes or local.spread == local.ctas_per_sm
    assert local.resident_ctas >= local.spread and local.tag == plan.tag + "/local-decays"
    with pytest.raises(ValueError, match="local_decays and requests_per_cta > 1"):
        KdaStepPlan(12, 6288, 64, 2, requests_per_cta=2, local_decays=True)


def test_a_lean_start_keeps_the_launch_and_the_shared_memory():
    """A lean start changes only the order of the CTA's first steps (the slot hint after the cluster arrive, the
    peers' barriers awaited after the copies), so the plan's geometry, shared memory and launch are the plain
    start's; a group of requests cannot take it."""
    for batch in (1, 8, 16, 64):
        plain = KdaStepPlan.for_shape(12, 6288, batch, H200_SMS, **knob_alone(lean_start=False))
        lean = KdaStepPlan.for_shape(12, 6288, batch, H200_SMS, **knob_alone(lean_start=True))
        assert dataclasses.replace(lean, lean_start=False) == plain and lean.tag == plain.tag + "/lean"
        assert (lean.smem_bytes, lean.launch_smem_bytes, lean.wave_requests) == (
            plain.smem_bytes, plain.launch_smem_bytes, plain.wave_requests
        )  # fmt: skip
    with pytest.raises(ValueError, match="lean_start and requests_per_cta > 1"):
        KdaStepPlan(12, 6288, 64, 2, requests_per_cta=2, lean_start=True)
    with pytest.raises(ValueError, match="lean_conv and requests_per_cta > 1"):
        KdaStepPlan(12, 6288, 64, 2, requests_per_cta=2, lean_conv=True)


def test_the_plan_refuses_what_the_kernel_cannot_take():
    with pytest.raises(ValueError, match="cluster of"):
        KdaStepPlan(12, 6288, 1, 16)
    with pytest.raises(ValueError, match="cluster of"):
        KdaStepPlan(12, 6288, 1, 3)
    with pytest.raises(ValueError, match="at least one head"):
        KdaStepPlan(0, 6288, 1, 8)
    with pytest.raises(ValueError, match="batch"):
        KdaStepPlan(12, 6288, 0, 8)
    with pytest.raises(ValueError, match="at least 6284"):
        KdaStepPlan(12, 6280, 1, 8)
    with pytest.raises(ValueError, match="16-byte"):
        KdaStepPlan(12, 6290, 1, 8)
    with pytest.raises(ValueError, match="int32 or int64"):
        KdaStepPlan(12, 6288, 1, 8, "int16")  # type: ignore[arg-type]


@pytest.mark.parametrize("tp", [8, 16])
@pytest.mark.parametrize("batch", [1, 2, 4, 8, 16, 64])
def test_a_small_grid_is_spread_over_the_sms_and_leaves_room_for_o_proj(tp, batch):
    """On the H200 the step's clusters took the first SMs the projection freed, eight CTAs to an SM (TP8 B1: 96
    CTAs on 26 SMs). The launch's shared-memory request must let exactly `spread` CTAs share an SM (not one more),
    where spread is as few as the grid allows, and still leave o_proj's four CTAs room beside one of them. It must
    hold whatever the driver charges a CTA beside its dynamic bytes, from nothing to the reserve and the cubin's
    static bytes both: at aa5aabc the request counted on both, and on the H200 two CTAs shared an SM at TP8 B1."""
    shard = K3.shard(tp)
    plan = KdaStepPlan.for_shape(shard.kda_heads, shard.kda_in_proj_rows, batch, 132)
    assert plan.spread == min(plan.ctas_per_sm, -(-plan.ctas // 132))
    # a padded request holds the spread whatever the driver charges a CTA beside it; an unpadded one must fit
    # ctas_per_sm at what it charges (1 KiB: a wide plan's four CTAs of 56.7 KB fit at that and not at 2 KiB)
    padded = plan.launch_smem_bytes > plan.smem_bytes
    for overhead in (0, 1024, 1024 + STATIC_SMEM) if padded else (1024,):
        fits = min(plan.ctas_per_sm, SMEM_PER_SM // (plan.launch_smem_bytes + overhead))
        assert fits == plan.spread, overhead  # never more per SM than the spread, and the spread itself fits
    assert plan.ctas <= fits * 132 or plan.spread == plan.ctas_per_sm  # the grid still fits in one wave
    assert plan.launch_smem_bytes >= plan.smem_bytes and plan.launch_smem_bytes % 128 == 0
    if (tp, batch) in ((8, 1), (16, 1), (16, 2)):
        assert plan.spread == 1 and plan.ctas <= 132  # one CTA per SM, on as many SMs as there are CTAs
    if plan.cluster == 2 and not plan.wide_warps:  # 512-thread CTAs, two per SM already: nothing to pad
        assert plan.launch_smem_bytes == plan.smem_bytes
    rows = min(batch, O_PROJ_MAX_BATCH)  # above (none at K3's batches), o_proj runs stock
    o_proj = OProjPlan.for_shape(*shard.kda_o_proj, rows, AttnResKind.from_tag("n8-add-norm"), 132)
    beside = plan.launch_smem_bytes + (1024 + STATIC_SMEM) + o_proj.ctas_per_sm * o_proj.cta_smem_bytes
    if plan.launch_smem_bytes > plan.smem_bytes:  # what the padding takes must not push o_proj off the SM
        assert beside <= SMEM_PER_SM, (plan.launch_smem_bytes, o_proj.cta_smem_bytes)
    verify = KdaVerifyPlan.for_shape(shard.kda_heads, shard.kda_in_proj_rows, batch, 132, tokens=4)
    assert verify.sm_count == 132 and verify.launch_smem_bytes == verify.smem_bytes  # verify: not spread


@pytest.mark.parametrize("tp, cluster", [(8, 8), (8, 2), (16, 4)])
def test_the_copies_fill_exactly_the_bytes_their_barriers_wait_for(tp, cluster):
    """Each transaction barrier completes only when the bytes it is armed with have landed: copies that drift from
    the plan's sizes would hang the kernel on the GPU. The channel runs the kernel copies (the plan's conv_runs) must
    cover the head's q and k and the CTA's v channels, contiguously in the local numbering, and sum to the armed
    bytes."""
    shard = K3.shard(tp)
    plan = KdaStepPlan(shard.kda_heads, shard.kda_in_proj_rows, 4, cluster)
    rows = plan.rows_per_cta
    for head in (0, plan.heads - 1):
        for rank in (0, cluster - 1):
            runs = plan.conv_runs(head, rank)
            first = head * HEAD_DIM + rank * rows
            assert [(s, n) for s, _, n in runs] == [
                (head * HEAD_DIM, HEAD_DIM),
                (plan.proj + head * HEAD_DIM, HEAD_DIM),
                (2 * plan.proj + first, rows),
            ]
            assert [local for _, local, _ in runs] == [0, HEAD_DIM, 2 * HEAD_DIM]
            channels = sum(n for _, _, n in runs)
            assert channels == plan.conv_local
            assert rows * GATE_RANK * 2 + channels * CONV_WIDTH * 2 == plan.weight_bytes
            assert channels * 2 + GATE_RANK * 2 + rows * 2 == plan.packed_bytes
            assert channels * (CONV_WIDTH - 1) * 2 == plan.tap_bytes


# --- what is built ----------------------------------------------------------------------------------------------


def test_builds_are_every_tp_and_batch_at_the_ranks_heads():
    every = step_builds()
    one = [
        b
        for b in every
        if b.plan.requests_per_cta == 1
        and not (b.plan.local_decays or b.plan.lean_start or b.plan.lean_conv or b.plan.joint_sums or b.plan.wide_warps)
    ]
    served = [
        b
        for b in every
        if b.plan == KdaStepPlan.for_shape(b.plan.heads, b.plan.rows, b.plan.batch, H200_SMS)
        and b.plan.requests_per_cta == 1
    ]
    served_lean = ["kda_step/tp8/b64/lean/lean-conv/wide-warps", "kda_step/tp16/b2/lean"]
    assert [b.name for b in served if b.plan.lean_start] == served_lean
    budgets = [b for b in one if not b.plan.warm_ahead]
    warm = [b for b in one if b.plan.warm_ahead]
    pairs = [b for b in every if b.plan.requests_per_cta > 1]
    # what kda_step_choice.toml serves, at every batch of the table (and B32, which only the budgets list)
    batches = (1, 2, 4, 8, 16, 64)
    assert [(b.tp, b.plan.batch) for b in served if b.plan.batch != 32] == [(tp, b) for tp in (8, 16) for b in batches]
    assert {b.tp: (b.plan.heads, b.plan.rows) for b in every} == {8: (12, 6288), 16: (6, 3216)}
    assert {(b.tp, b.plan.batch): b.plan.cluster for b in served if b.plan.batch != 32} == CLUSTER
    # every register budget at the batches where it changes what an SM holds, at the plan's cluster, whichever the
    # choice file serves; below them, only the served 1024-thread build
    wide = (16, 32, 64)
    assert {b.name for b in budgets} == {f"kda_step/tp{tp}/b{b}" for tp in (8, 16) for b in (*batches, 32)} | {
        f"kda_step/tp{tp}/b{b}/t1536" for tp in (8, 16) for b in wide
    }
    for b in budgets:  # each the plain step (the served lean start, lean conv and wide warps have their own builds)
        chosen = KdaStepPlan.for_shape(b.plan.heads, b.plan.rows, b.plan.batch, H200_SMS)
        assert b.plan == dataclasses.replace(
            chosen, resident_threads=b.plan.resident_threads, **knob_alone(lean_start=False)
        )
        if b.plan.resident_threads == 1536:  # three CTAs of 512 threads an SM, as many used as the grid needs
            assert b.plan.ctas_per_sm == 3 and b.plan.spread == min(3, -(-b.plan.ctas // H200_SMS)), b.name
            assert 3 * (b.plan.smem_bytes + 2048) <= 228 * 1024
            assert b.plan.spread < 3 or b.plan.launch_smem_bytes == b.plan.smem_bytes
    # warming at B32 and B64, at every budget built there whose grid runs in more than one wave (not TP16 B32 at
    # 1536 threads, whose 33 requests a wave cover it)
    assert {b.name for b in warm} == {
        "kda_step/tp8/b32/warm",
        "kda_step/tp8/b64/warm",
        "kda_step/tp8/b32/t1536/warm",
        "kda_step/tp8/b64/t1536/warm",
        "kda_step/tp16/b32/warm",
        "kda_step/tp16/b64/warm",
        "kda_step/tp16/b64/t1536/warm",
    }
    unwarmed = {(b.tp, b.plan) for b in budgets}
    assert all((b.tp, dataclasses.replace(b.plan, warm_ahead=False)) in unwarmed for b in warm)
    assert all(0 < b.plan.ahead < b.plan.batch for b in warm)
    # two requests a cluster at B32 and B64, at the plan's cluster and 1024 threads
    assert {b.name for b in pairs} == {f"kda_step/tp{tp}/b{b}/r2" for tp in (8, 16) for b in (32, 64)}
    for b in pairs:
        chosen = KdaStepPlan.for_shape(b.plan.heads, b.plan.rows, b.plan.batch, H200_SMS)
        none = knob_alone(lean_start=False)  # none with a group
        assert b.plan == dataclasses.replace(chosen, resident_threads=1024, requests_per_cta=2, **none)
        assert b.plan.resident_ctas == b.plan.ctas_per_sm == 2 and b.plan.groups == b.plan.batch // 2, b.name

    # each knob alone, at the served plan otherwise: with four-row warps and every warp's conv where the choice serves
    # the lean conv with wide warps (TP8 B16), so each has its plain twin
    def alone(b: KdaStepBuild, **knob: bool) -> KdaStepPlan:
        chosen = KdaStepPlan.for_shape(b.plan.heads, b.plan.rows, b.plan.batch, H200_SMS)
        return dataclasses.replace(chosen, **knob_alone(**knob))

    # every CTA computing its head's decays at B1, B4 and B8
    local = [b for b in every if b.plan.local_decays]
    assert {b.name for b in local} == {f"kda_step/tp{tp}/b{b}/local-decays" for tp in (8, 16) for b in (1, 4, 8)}
    for b in local:
        assert b.plan == alone(b, local_decays=True), b.name
    # a lean start at B1, B2, B8, B16 and B64
    lean = [b for b in every if b.plan.lean_start and not (b.plan.lean_conv or b.plan.joint_sums or b.plan.wide_warps)]
    assert len(lean) == 10 and {(b.tp, b.plan.batch) for b in lean} == {
        (t, n) for t in (8, 16) for n in (1, 2, 8, 16, 64)
    }
    for b in lean:
        assert b.plan == alone(b, lean_start=True) and b.name.endswith("/lean"), b.name
    # a lean conv at B1, B16 and B64
    conv = [b for b in every if b.plan.lean_conv and not b.plan.wide_warps]
    assert {(b.tp, b.plan.batch) for b in conv} == {(t, n) for t in (8, 16) for n in (1, 16, 64)} and len(conv) == 6
    for b in conv:
        assert b.plan == alone(b, lean_conv=True) and b.name.endswith("/lean-conv"), b.name
    # joint sums at B1, B16 and B64
    joint = [b for b in every if b.plan.joint_sums]
    assert {(b.tp, b.plan.batch) for b in joint} == {(t, n) for t in (8, 16) for n in (1, 16, 64)} and len(joint) == 6
    for b in joint:
        assert b.plan == alone(b, joint_sums=True) and b.name.endswith("/joint-sums"), b.name
    assert {b.kernel for b in every} == {"kda_step"} and {b.plan.slot_dtype for b in every} == {"int32"}
    assert K3_KERNEL_BUILDS.kda_step_builds() == every


def test_build_tags_count_what_the_code_must_hold():
    tags = {b.name: b.tags for b in step_builds()}
    b1 = tags["kda_step/tp8/b1"]
    assert (b1["cluster"], b1["threads"], b1["ctas"], b1["ctas_per_sm"]) == (8, 128, 96, 8)
    copies = ("weight_copies", "packed_copies", "tap_copies", "state_copies")
    assert tuple(b1[k] for k in copies) == (4, 5, 3, 1) and b1["prefetches"] == 4
    assert (b1["early_loads"], b1["late_loads"], b1["waits"], b1["pushes"]) == (5, 2, 8, 3)
    assert (b1["state_stores"], b1["tap_stores"], b1["out_stores"], b1["shuffles"]) == (4, 3, 2, 57)
    b64 = tags["kda_step/tp16/b64"]
    assert (b64["cluster"], b64["threads"], b64["ctas"], b64["ctas_per_sm"]) == (2, 512, 768, 2)
    assert (b64["warm_ahead"], b64["warm_prefetches"], b64["late_loads"]) == (False, 0, 2)
    assert (b64["requests_per_cta"], b64["barriers"], b64["armed"]) == (1, 6, 6)
    pair = tags["kda_step/tp16/b64/r2"]  # all but the weights once per request; one wait for the weights
    assert (pair["barriers"], pair["armed"], pair["packed_copies"], pair["state_copies"], pair["prefetches"]) == (
        12, 11, 10, 2, 8
    )  # fmt: skip
    assert (pair["early_loads"], pair["late_loads"], pair["waits"], pair["out_stores"], pair["shuffles"]) == (
        6, 4, 11, 6, 2 * b64["shuffles"]
    )  # fmt: skip
    local = tags["kda_step/tp8/b1/local-decays"]  # no decay barrier armed or waited on, only the norm pushed
    assert (local["armed"], local["waits"], local["pushes"], local["weight_copies"], local["early_loads"]) == (
        5, 7, 1, 5, 3
    )  # fmt: skip
    assert local["shuffles"] == b1["shuffles"]  # two f_b rows a pass of the half-warps' loop, as before
    warm = tags["kda_step/tp16/b64/warm"]  # the next wave's slot, its state rows and three tap runs
    assert (warm["warm_ahead"], warm["warm_prefetches"], warm["late_loads"]) == (True, 4, 3)
    assert {k: v for k, v in warm.items() if k not in ("warm_ahead", "warm_prefetches", "late_loads")} == {
        k: v for k, v in b64.items() if k not in ("warm_ahead", "warm_prefetches", "late_loads")
    }


def test_wide_warp_tags_count_eight_rows_a_warp():
    """A wide warp stores eight state rows, pushes four decay pairs and one pair of norm partials, reduces four f_b
    rows and eight rows' S k and S q, loads four dt_bias values, and stores its outputs as one 16-byte vector; its CTA
    has half the warps, so twice as many fit the same budget."""
    tags = {b.name: b.tags for b in step_builds()}
    wide, four = tags["kda_step/tp8/b16/t1536/wide-warps"], tags["kda_step/tp8/b16/t1536"]
    assert (wide["threads"], wide["ctas_per_sm"], four["threads"], four["ctas_per_sm"]) == (256, 6, 512, 3)
    assert (wide["state_stores"], wide["pushes"], wide["early_loads"]) == (8, 5, 1 + 4 + 1 + 1)
    assert (four["state_stores"], four["pushes"], four["early_loads"]) == (4, 3, 1 + 2 + 1 + 1)
    assert (wide["shuffles"], four["shuffles"]) == (4 * 4 + 4 + 8 * 10 + 5, 2 * 4 + 4 + 4 * 10 + 5)
    assert (wide["wide_out_stores"], wide["wide_live_out"], four["wide_out_stores"], four["wide_live_out"]) == (
        2,
        1,
        0,
        0,
    )
    assert tags["kda_step/tp8/b16/wide-warps"]["ctas_per_sm"] == 4 and wide["smem_bytes"] == four["smem_bytes"]
    # four CTAs of 56.7 KB and the driver's 1 KiB each fit an SM's 228 KiB: shared memory, not the 40 registers, holds
    # the wide build at 1536 threads to four (the GPU test asks the driver); the four-row plans' registers hold theirs
    plans = {b.name: b.plan for b in step_builds()}
    assert [plans[n].resident_ctas for n in ("kda_step/tp8/b16/t1536/wide-warps", "kda_step/tp8/b16/t1536")] == [4, 3]


def test_expectations_judge_every_kda_step_build():
    expectations = parse_expectations(K3_KERNEL_BUILDS.expectations_text(), "expectations.toml", "sm_90a")
    builds = select_builds(K3_KERNEL_BUILDS, "sm_90a", expectations, "kda_step/*")  # every named tag exists
    # 14 at 1024 threads per SM, 6 at 1536, 7 warming the next wave, 4 of request pairs, 6 with local decays, 10 with
    # a lean start, 6 with a lean conv, 6 with joint sums, 12 with wide warps, 10 with wide warps and the lean conv,
    # 3 of those capped at three CTAs an SM, 6 of those with a lean start
    assert len(builds) == 90
    step = expectations["kda_step"]
    assert step.max_registers == 64 and step.max_frame_bytes == 0 and len(step.rules) >= 40


def test_a_tp_the_model_cannot_shard_is_a_build_table_error(monkeypatch):
    table = K3_KERNEL_BUILDS.table | {"kda_step": K3_KERNEL_BUILDS.table["kda_step"] | {"tp": [7]}}
    builds = K3KernelBuilds()
    monkeypatch.setattr(K3KernelBuilds, "table", table)
    with pytest.raises(ValueError, match=r"builds\.toml kda_step\.tp"):
        builds.kda_step_builds()


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")
def test_the_launcher_refuses_a_step_off_a_cuda_device():
    import torch

    from k3_decode.kernels import kda_step_op
    from k3_decode.reference.kda import KdaCache

    spec = KdaSpec.for_rank(K3, 16)
    packed = torch.zeros(2, spec.in_proj_rows, dtype=torch.bfloat16)
    cache = KdaCache(torch.zeros(3, spec.conv_channels, 3, dtype=torch.bfloat16), torch.zeros(3, 6, 128, 128))
    with pytest.raises(ValueError, match="CUDA device"):
        kda_step_op.decode_step(spec, None, packed, cache, torch.ones(2, dtype=torch.int32))


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")
def test_the_kda_step_provider_is_registered_and_binds_its_call_only_on_a_gpu():
    """It passed its GPU run: in PROVIDERS and the op table specializes op kda; it binds exactly the runner call that
    carries op kda; off a GPU it refuses to bind."""
    import torch

    from k3_decode.executor.executor import RUNNER_CALLS, ProviderTarget
    from k3_decode.kernels import providers
    from k3_decode.runtime.optable import load_op_table

    pending = next(p for p in providers.PROVIDERS if p.op == "kda")
    assert isinstance(pending, providers.CuteKdaStepProvider) and pending.name == "cute-kda-step"
    assert "kda" in load_op_table().specialized_ops()
    assert dict(pending.launches) == {"KdaStepKernel": 1}  # a substring of the kernel's CUDA name
    assert "KdaStepKernel" in providers._launch_counts()  # its device counter can be read
    assert pending.max_rows(8) is None and pending.max_rows(16) is None  # not measured yet: not limited
    assert [call for call, ops in RUNNER_CALLS["kda"][1].items() if "kda" in ops] == ["kda_decode", "kda_verify"]
    with pytest.raises(providers.ProviderBindError, match="runs on a CUDA device"):
        pending.bind(ProviderTarget(K3, 8, 0, torch.device("cpu")))


# --- the real builds (CuTe DSL, no GPU) ---------------------------------------------------------------------------


@pytest.mark.slow
@needs_cutedsl
def test_one_build_per_cluster_compiles_and_meets_its_expectations(tmp_path):
    out = tmp_path / "out"
    proc = build_command(tmp_path, "--out", str(out), "--json", "--jobs", "2", "--match", "kda_step/tp8/b[148]")
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout)["subjects"]["K3_KERNEL_BUILDS"]
    assert report["ok"] and sorted(b["tags"]["cluster"] for b in report["builds"]) == [2, 4, 8]
    assert all(b["ok"] and len(b["checks"]) >= 45 for b in report["builds"])  # the rules ran, not skipped

    # Facts read straight from the artifacts, independent of the expectations file.
    bodies = set()
    for b in report["builds"]:
        name, tags = b["build"], b["tags"]
        ptx = (out / name / "kernel.ptx").read_text()
        sass = (out / name / "kernel.sass").read_text()
        (res,) = cubin_resources((out / name / "kernel.cubin").read_bytes()).values()
        assert re.search(r"^\.target sm_90a$", ptx, re.M), name
        assert res.frame_bytes == 0 and not re.search(r"\b(LDL|STL)\b", sass), f"{name} spills"
        assert res.registers * tags["threads"] * tags["ctas_per_sm"] <= 65536, (name, res)
        assert re.search(rf"^\.minnctapersm {tags['ctas_per_sm']}$", ptx, re.M), name
        assert res.shared_bytes <= STATIC_SMEM, (name, res)  # what the residency test above assumes
        head, _, tail = sass.partition("ACQBULK")
        assert tail, f"{name} has no griddepcontrol.wait"
        # Before the wait: the weights' four bulk copies, the four L2 prefetches, five scalar loads; no shared read.
        assert (head.count("UBLKCP"), head.count("UBLKPF"), len(re.findall(r"\bLDG\b", head))) == (4, 4, 5), name
        assert "LDS" not in head and "STG" not in head, name
        assert ptx.count("st.async.shared::cluster") == 3 and ptx.count("barrier.cluster.wait;") == 2, name
        assert not re.search(r"\b(fma|mul|add)(\.rn)?\.(bf16|f16)", ptx), f"{name} has half-precision math"
        bodies.add(ptx.split(".entry", 1)[1].split("(", 1)[1])
    assert len(bodies) == 3  # the plans differ in the code (block size, offsets, copy sizes)


def _broken(text: str) -> str:
    """The real expectations with two of the kernel's numbers made wrong by one step each."""
    head, sep, rest = text.partition("[sm_90a.kda_step]\n")
    section, after, tail = rest.partition("\n[sm_90a.")  # the decode kernel's table only, not the verify step's
    rule = "pattern = 'cp\\.async\\.bulk\\.shared::cluster\\.global\\.mbarrier::complete_tx::bytes'\n"
    rule += "before = 'griddepcontrol\\.wait;'\ncount = \"weight_copies\""
    assert sep and section.count(rule) == 1 and section.count("max_registers = 64") == 1
    section = section.replace("max_registers = 64", "max_registers = 32").replace(rule, rule[:-1] + ' + 1"')
    return head + sep + section + after + tail


@pytest.mark.slow
@needs_cutedsl
def test_a_violated_expectation_fails_the_build(tmp_path):
    broken = tmp_path / "broken.toml"
    broken.write_text(_broken(K3_KERNEL_BUILDS.expectations_text()))
    out = tmp_path / "out"
    proc = build_command(tmp_path, "--out", str(out), "--expectations", str(broken), "--match", "kda_step/tp16/b2")
    assert proc.returncode == 1, proc.stderr
    (result,) = json.loads((out / "report.json").read_text())["builds"]
    failed = sorted(c["name"] for c in result["checks"] if not c["passed"])
    assert len(failed) == 2 and failed[1] == "registers" and failed[0].startswith("ptx 'cp\\\\.async\\\\.bulk"), failed
    held = [c["name"] for c in result["checks"] if c["passed"]]
    assert held[:2] == ["compiles", "ptx .target"] and any("UBLKCP" in name for name in held)
    assert "0 of 1 builds passed" in proc.stderr and re.search(r"registers \(\d+ <= 32\)", proc.stderr)


# Kernels with one synchronization removed (the attribute is patched out in the compiling process only), and rules
# that must catch each: without griddepcontrol.wait the packed row is read while the in_proj may still write it;
# without the cluster barrier waits a CTA pushes into peers whose barriers may not exist yet and rewrites taps a peer
# may not have read.
BROKEN_KERNELS = {
    "griddepcontrol_wait": ("ptx 'griddepcontrol\\\\.wait;'", "sass has '\\\\bACQBULK\\\\b'"),
    "cluster_wait": ("ptx 'barrier\\\\.cluster\\\\.wait;'", "sass '\\\\bUCGABAR_(ARV|WAIT)\\\\b'"),
}


@pytest.mark.slow
@needs_cutedsl
@pytest.mark.parametrize("removed", sorted(BROKEN_KERNELS))
def test_a_kernel_without_its_synchronization_fails_its_build(tmp_path, removed):
    # The architecture first: CuTe DSL reads it when cutlass is imported, here before the command would set it.
    patch = f"cute.arch.{removed} = lambda *args, **kwargs: None"
    prelude = f"import os\nos.environ['CUTE_DSL_ARCH'] = 'sm_90a'\nimport cutlass.cute as cute\n{patch}"
    out = tmp_path / "out"
    proc = build_command(tmp_path, "--out", str(out), "--match", "kda_step/tp16/b2", prelude=prelude)
    assert proc.returncode == 1, proc.stderr
    (result,) = json.loads((out / "report.json").read_text())["builds"]
    failed = {c["name"] for c in result["checks"] if not c["passed"]}
    assert "compiles" not in failed and "registers" not in failed  # it built; the synchronization rules caught it
    assert set(BROKEN_KERNELS[removed]) <= failed, sorted(failed)
    assert len(failed) <= 8, sorted(failed)  # those rules, not everything (the SASS was read)


@pytest.mark.slow
@needs_cutedsl
def test_the_larger_budget_spills_with_the_gate_read_before_the_norm_wait(tmp_path):
    """The broken case of the 40-register builds: with the output gate read before the norm exchange's wait, as the
    64-register builds read it (the kernel's comparison patched in the compiling process only), ptxas spills and the
    frame and local-memory rules fail the build."""
    patch = (
        "import os\nos.environ['CUTE_DSL_ARCH'] = 'sm_90a'\nimport cutlass.cute as cute\n"
        "from k3_decode.kernels import kda_step\nkda_step.RESIDENT_THREADS = 1536\n"
    )
    failed = failed_checks_of_broken_build(tmp_path, "kda_step/tp16/b64/t1536", patch)
    assert failed == {"local-memory frame bytes", "sass '\\\\b(LDL|STL)\\\\b'"}, sorted(failed)


WARM_FIRST = """
import os
os.environ["CUTE_DSL_ARCH"] = "sm_90a"
import cutlass
import cutlass.cute as cute
from k3_decode.kernels import kda_step

own = kda_step.KdaStepKernel._copy_state


@cute.jit
def warm_first(self, state_s, taps_s, state, slot, conv_row, columns: cutlass.Constexpr[int], bars, place):
    rows = self.plan.rows_per_cta
    kda_step.bulk_prefetch_l2(state[slot, place.head, place.rank * rows, None].iterator, rows * 512)
    own(self, state_s, taps_s, state, slot, conv_row, columns, bars, place)


kda_step.KdaStepKernel._copy_state = warm_first
"""


@pytest.mark.slow
@needs_cutedsl
def test_a_next_wave_warmed_before_the_ctas_own_copies_fails_its_build(tmp_path):
    """The broken case of the warming builds: a prefetch issued after the wait but before the CTA's own state and
    tap copies (`_copy_state` patched in the compiling process only) puts the next wave's reads ahead of this
    one's. The order rule catches it, and the prefetch counts do."""
    failed = failed_checks_of_broken_build(tmp_path, "kda_step/tp16/b64/warm", WARM_FIRST)
    rules = [n.split(" before ") for n in failed]  # a rule's name: "ptx '<pattern>'[ before '<pattern>']"
    order = [r for r in rules if len(r) == 2 and "shared::cluster" in r[0] and "prefetch" in r[1]]
    prefetches = [r for r in rules if "prefetch" in r[0]]
    assert len(order) == 1 and len(prefetches) == 2 and len(failed) == 3, sorted(failed)


UNARMED_SECOND = """
import os
os.environ["CUTE_DSL_ARCH"] = "sm_90a"
import cutlass.cute as cute
from k3_decode.kernels import kda_step_group


@cute.jit
def unarmed(self, bars, exchange_bytes):
    pass


kda_step_group.KdaStepGroupKernel._arm = unarmed
"""


@pytest.mark.slow
@needs_cutedsl
def test_a_group_kernel_that_leaves_its_second_requests_barriers_unarmed_fails_its_build(tmp_path):
    """The broken case of the group builds: the second request's barriers initialized but never armed with the
    bytes that complete them (`_arm` patched out in the compiling process only), so its copies would complete
    barriers that expect nothing. The arming count catches it, and nothing else needs to."""
    failed = sorted(failed_checks_of_broken_build(tmp_path, "kda_step/tp16/b64/r2", UNARMED_SECOND))
    assert len(failed) == 1 and "expect_tx" in failed[0], failed


STILL_WAITS_FOR_DECAYS = """
import os
os.environ["CUTE_DSL_ARCH"] = "sm_90a"
import dataclasses
from k3_decode.kernels import kda_step

finish = kda_step.KdaStepKernel._finish_request


def waits_for_the_exchange(self, *args):
    plan = self.plan
    self.plan = dataclasses.replace(plan, local_decays=False)  # the phase after the conv as if decays were pushed
    try:
        return finish(self, *args)
    finally:
        self.plan = plan


kda_step.KdaStepKernel._finish_request = waits_for_the_exchange
"""


@pytest.mark.slow
@needs_cutedsl
def test_a_local_decays_kernel_that_still_waits_for_the_exchange_fails_its_build(tmp_path):
    """The broken case of the local-decays builds: the decays computed in the CTA, but the delta rule still waiting
    on the decay barrier, which nothing arms or completes any more, so every live CTA would hang on the GPU. The
    wait count catches it."""
    failed = sorted(failed_checks_of_broken_build(tmp_path, "kda_step/tp8/b1/local-decays", STILL_WAITS_FOR_DECAYS))
    assert len(failed) == 1 and "try_wait" in failed[0], failed


PLAIN_START_TAGGED_LEAN = """
import os
os.environ["CUTE_DSL_ARCH"] = "sm_90a"
import dataclasses
from k3_decode.kernels import kda_step, kda_step_group


def plain_start(plan, trace=False):
    return kda_step.KdaStepKernel(dataclasses.replace(plan, lean_start=False), trace)


kda_step_group.step_kernel = plain_start
"""


@pytest.mark.slow
@needs_cutedsl
def test_a_lean_build_that_starts_like_the_plain_one_fails_its_build(tmp_path):
    """The broken case of the lean builds: the plain start compiled under a lean build's name and tags (the slot
    hint read before the cluster arrive, the peers' barriers awaited before the dependency wait and the copies).
    Each of the three order rules of a lean start catches it, and nothing else needs to."""
    failed = sorted(failed_checks_of_broken_build(tmp_path, "kda_step/tp8/b64/lean", PLAIN_START_TAGGED_LEAN))
    assert len(failed) == 3, failed
    wait_first, copies_late, hint_first = failed
    assert "before 'griddepcontrol" in wait_first and wait_first.startswith("ptx 'barrier"), failed
    assert copies_late.startswith("ptx 'cp") and "before 'barrier" in copies_late, failed
    assert hint_first.startswith("ptx 'ld") and "arrive" in hint_first, failed


LAUNCH_ON_CPU = """
import torch
from k3_decode.kernels import kda_step_op
from k3_decode.kernels.kda_step_plan import KdaStepPlan

compiled = kda_step_op._compiled(KdaStepPlan.for_shape(6, 3216, 3))
p = 768
def z(*shape, dtype=torch.bfloat16):
    return torch.zeros(*shape, dtype=dtype)
f32, i32 = torch.float32, torch.int32
tensors = (z(3, 3216), z(p, 128), z(3 * p * 4), z(6, dtype=f32), z(p, dtype=f32), z(128), z(5, 3 * p * 3),
           z(5, 6, 128, 128, dtype=f32), z(3, dtype=i32), z(3, p), z(1, dtype=i32))
kda_step_op.launch(compiled, tensors, (-5.0, 1e-6, 1e-5), 0)
"""


@pytest.mark.slow
@needs_cutedsl
@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")
def test_the_gpu_launch_path_binds_every_argument(tmp_path):
    """The launcher the GPU test uses compiles from the same fake signature (with a run-time slot count) and hands
    over every argument; on a machine without a driver the call gets as far as the launch (CUDA error 35)."""
    assert_launch_reaches_the_driver(LAUNCH_ON_CPU, tmp_path)


_BRANCH = re.compile(r"^\s+/\*[0-9a-f]+\*/\s+@!?U?P\d+ BRA `\((\.L_x_\d+)\)")


def skipped_conv_blocks(sass: str) -> list[int]:
    """The MUFU counts of the forward ranges a predicated branch jumps over that hold MUFU but no shuffle: the conv's
    SiLU (an ex2 and a reciprocal per channel, 8 channels a lane) is the only such work in the step."""
    lines = sass.splitlines()
    labels = {line.rstrip(":"): i for i, line in enumerate(lines) if re.match(r"^\.L_x_\d+:$", line)}
    found = []
    for i, line in enumerate(lines):
        m = _BRANCH.match(line)
        if m and labels.get(m.group(1), -1) > i and "BRA.U.ANY" not in line:
            body = lines[i + 1 : labels[m.group(1)]]
            mufu = sum("MUFU." in b for b in body)
            if mufu and not any("SHFL" in b for b in body):
                found.append(mufu)
    return found


@pytest.mark.slow
@needs_cutedsl
@pytest.mark.parametrize("batch", [1, 64])
def test_a_lean_conv_branches_past_the_conv_and_the_plain_build_does_not(tmp_path, batch):
    """The lean conv's point is that warps 2 and up skip the conv's ~200 instructions a warp (the step is bound by
    instruction issue from B16: docs/kda-layer-h200.md): its SASS has a predicated branch over a block holding the
    conv's 16 MUFU (8 SiLUs) and no shuffle. The broken case is the plain build of the same plan, which runs the conv
    in every warp and has no such branch."""
    builds = [b for b in step_builds() if b.tp == 8 and b.plan.batch == batch]
    (conv,) = [b for b in builds if b.plan.lean_conv and not b.plan.wide_warps]
    (plain,) = [b for b in builds if b.plan == dataclasses.replace(conv.plan, lean_conv=False)]  # the served build
    got = {b.name: skipped_conv_blocks(b.compile("sm_90a").sass) for b in (plain, conv)}
    assert got == {plain.name: [], conv.name: [16]}, got


@pytest.mark.slow
@needs_cutedsl
def test_joint_sums_trade_forty_butterfly_shuffles_for_twenty(tmp_path):
    """Joint sums reduce each warp's four rows' S k, then S q, together (primitives.warp_sums4): 12 butterfly
    shuffles and 8 indexed ones where the plain build has 40 butterfly ones, and 28 fewer adds, at TP8 B64 (the
    served lean start, at 1024 threads) without a frame. Both builds pass their expectations; the broken case is the
    plain build's code judged with the joint build's tags (its butterflies and broadcasts counted as joint), which
    must fail exactly the two shuffle counts."""
    expect = parse_expectations(K3_KERNEL_BUILDS.expectations_text(), "expectations.toml", "sm_90a")["kda_step"]
    builds = [b for b in step_builds() if b.tp == 8 and b.plan.batch == 64]
    (joint,) = [b for b in builds if b.plan.joint_sums]
    (plain,) = [b for b in builds if b.plan == dataclasses.replace(joint.plan, joint_sums=False)]  # the served build
    counts, arts = {}, {}
    for b in (plain, joint):
        arts[b.name] = art = b.compile("sm_90a")
        ops = re.findall(r"\b(SHFL\.BFLY|SHFL\.IDX|FADD)\b", art.sass)
        counts[b.name] = {op: ops.count(op) for op in ("SHFL.BFLY", "SHFL.IDX", "FADD")}
        result = judge(b, "sm_90a", art, "", expect, tmp_path / "ok")
        assert result.ok and result.resources.frame_bytes == 0, [c for c in result.checks if not c.passed]
    mine, theirs = counts[joint.name], counts[plain.name]
    assert theirs["SHFL.BFLY"] - mine["SHFL.BFLY"] == 28 and mine["SHFL.IDX"] - theirs["SHFL.IDX"] == 8, counts
    assert theirs["FADD"] - mine["FADD"] == 28, counts
    posing = dataclasses.replace(plain, plan=joint.plan)  # the joint build's name and tags, the plain build's code
    failed = [
        c.name for c in judge(posing, "sm_90a", arts[plain.name], "", expect, tmp_path / "bad").checks if not c.passed
    ]
    assert len(failed) == 2 and "bfly" in failed[0] + failed[1] and "idx" in failed[0] + failed[1], failed


def _roles(plan: KdaStepPlan) -> list[int]:
    """One thread of each part a step CTA's threads play: warp 0's q lanes (0, 15) and k lanes (16, 31), warp 1's
    v lanes (first, last) and a lane past them, warp 2, and the last thread."""
    v_last = 32 + plan.v_lanes - 1
    return sorted({0, 15, 16, 31, 32, v_last, v_last + 1, 64, 32 * plan.warps - 1})


# The knobs that claim the plain build's arithmetic: a lean conv skips only discarded work, a lean start only moves
# when its copies are issued.
# Each such build whose twin with the knob off is built too (a lean start beside a lean conv has none).
_STEP_PLANS = {b.plan for b in step_builds()}
SAME_VALUE_BUILDS = [
    (b, k)
    for b in step_builds()
    for k in ("lean_conv", "lean_start")
    if getattr(b.plan, k) and dataclasses.replace(b.plan, **{k: False}) in _STEP_PLANS
]
assert {k for _, k in SAME_VALUE_BUILDS} == {"lean_conv", "lean_start"}


@pytest.mark.parametrize("build, knob", SAME_VALUE_BUILDS, ids=[b.name for b, _ in SAME_VALUE_BUILDS])
def test_a_lean_build_stores_the_plain_builds_values_in_every_role(build, knob):
    """A lean conv or a lean start must store the same expressions at the same addresses as the build with the
    knob off, in every thread (harness.ptx_values: the PTX run per thread, integers concrete, floats symbolic).
    Before primitives.fma pinned the fused products, the lean conv's L2 norms of q and k fused another product
    than the plain build's and their states differed by an ulp on the GPU; this check fails on that code at
    every lean-conv build. The broken case: the joint-sums build of the same shape reorders its reductions, and
    the check must see it in every thread."""
    from harness.ptx_values import compare

    same_tp = [b for b in step_builds() if b.tp == build.tp]
    (plain,) = [b for b in same_tp if b.plan == dataclasses.replace(build.plan, **{knob: False})]
    block = (build.plan.cluster - 1, 1, min(1, build.plan.batch - 1))  # a peer's rank, head 1, a live request
    threads = _roles(build.plan)
    plain_ptx = sm90_ptx(plain)
    assert compare(plain_ptx, sm90_ptx(build), threads, block) == []
    # joint sums are not built with wide warps, so a wide pair keeps its broken case in the wide tests below
    twin = None if plain.plan.wide_warps else dataclasses.replace(plain.plan, joint_sums=True)
    joint = [b for b in same_tp if b.plan == twin]
    if joint:
        diffs = compare(plain_ptx, sm90_ptx(joint[0]), threads, block)
        assert {d.thread for d in diffs} == set(threads), [str(d) for d in diffs[:3]]


# Wide warps (KdaStepPlan.wide_warps): eight value rows a warp, half the warps a CTA, the four-row build's arithmetic.
WIDE_BUILDS = [b for b in step_builds() if b.plan.wide_warps]
WIDE_LANES = (0, 1, 16, 31)  # pushes to CTA 0 and 1, the q / k halves (each half-warp's decays), the last lane


def four_row_twin(build: KdaStepBuild) -> KdaStepBuild:
    """The plain step at the wide build's plan: four-row warps, and every warp running the conv."""
    return KdaStepBuild(build.tp, dataclasses.replace(build.plan, **knob_alone()))


def lane_groups(wide: KdaStepPlan, four: KdaStepPlan) -> list[tuple[list[int], list[int]]]:
    """Per lane, every warp of each build: a wide warp w does four-row warps 2w and 2w + 1's rows, and its lane
    pushes other channels' decays than either, but a lane of all warps together covers the same rows and
    channels in both."""
    return [
        ([32 * w + lane for w in range(four.warps)], [32 * w + lane for w in range(wide.warps)]) for lane in WIDE_LANES
    ]


def cta_instructions(build: KdaStepBuild) -> int:
    """Instructions a live CTA's warps run (harness.ptx_values), lane 5 standing for its warp."""
    from harness.ptx_values import run_threads

    block = (build.plan.cluster - 1, 1, min(1, build.plan.batch - 1))
    lanes = [32 * w + 5 for w in range(build.plan.warps)]
    return sum(run.executed for run in run_threads(sm90_ptx(build), lanes, block))


def test_wide_warps_are_built_at_every_budget_beside_the_served_plan():
    alone = [b for b in WIDE_BUILDS if not b.plan.lean_conv]
    assert {(b.tp, b.plan.batch, b.plan.resident_threads) for b in alone} == {
        (tp, batch, threads) for tp in (8, 16) for batch in (1, 16, 64) for threads in (1024, 1536)
    }
    # and with the lean conv at 1024 threads, the budget whose four CTAs an SM the layer rounds run
    together = [b for b in WIDE_BUILDS if b.plan.lean_conv and not b.plan.max_ctas_per_sm]
    assert {(b.tp, b.plan.batch, b.plan.resident_threads) for b in together} == {
        (tp, batch, 1024) for tp in (8, 16) for batch in (1, 2, 8, 16, 32, 64)
    }
    # and so with the lean start: served at TP8 B64, built for its rounds at B1, B2 and B8
    lean = [b for b in together if b.plan.lean_start]
    assert {(b.tp, b.plan.batch) for b in lean} == {(tp, n) for tp in (8, 16) for n in (1, 2, 8)} | {(8, 64)}
    # and so, held to three CTAs an SM where the grid would put four there (768 and 1536 CTAs)
    capped = [b for b in WIDE_BUILDS if b.plan.max_ctas_per_sm]
    assert {(b.tp, b.plan.batch, b.plan.ctas, b.plan.spread) for b in capped} == {
        (8, 32, 768, 3), (8, 64, 1536, 3), (16, 64, 768, 3)
    }  # fmt: skip
    for b in WIDE_BUILDS:
        served = KdaStepPlan.for_shape(
            b.plan.heads, b.plan.rows, b.plan.batch, resident_threads=b.plan.resident_threads
        )
        knobs = {"wide_warps": True, "lean_conv": b.plan.lean_conv, "max_ctas_per_sm": b.plan.max_ctas_per_sm}
        assert b.plan == dataclasses.replace(served, **knobs, lean_start=b.plan.lean_start), b.name
        assert b.plan.lean_start == served.lean_start or b in lean, b.name
        assert b.plan.lean_conv or not b.plan.max_ctas_per_sm, b.name
        assert b.name.endswith("/wide-warps" + ("/cap3" if b.plan.max_ctas_per_sm else "")), b.name
        assert b.plan.warps * 2 == four_row_twin(b).plan.warps and b.plan.slots == four_row_twin(b).plan.slots == 32


# A capped build's PTX is its uncapped twin's, line for line (test_a_capped_build_is_the_uncapped_builds_code), so
# comparing its values again would only repeat the twin's comparison (about 11 s of CPU a build). Likewise a lean
# start beside the pair whose pair is built: it stores the pair's values (SAME_VALUE_BUILDS), which store these.
_SAME_AS_BUILT = {b.name for b, knob in SAME_VALUE_BUILDS if knob == "lean_start" and b.plan.wide_warps}
UNCAPPED_WIDE = [b for b in WIDE_BUILDS if not b.plan.max_ctas_per_sm and b.name not in _SAME_AS_BUILT]


@pytest.mark.slow
@needs_cutedsl
@pytest.mark.parametrize("build", UNCAPPED_WIDE, ids=[b.name for b in UNCAPPED_WIDE])
def test_a_wide_build_stores_the_four_row_builds_values(build):
    """Every lane of all warps together stores the same expressions at the same addresses in both builds
    (harness.ptx_values, the copies followed): the state rows, the outputs, the rewritten taps, q and k, the
    decays and the norm partials pushed to each CTA (a wide warp pushes its two four-row partials as one pair,
    into the four-row warps' slots, so every CTA sums the same 32 partials in the same order)."""
    from harness.ptx_values import compare_groups

    twin = four_row_twin(build)
    block = (build.plan.cluster - 1, 1, min(1, build.plan.batch - 1))  # a peer's rank, head 1, a live request
    groups = lane_groups(build.plan, twin.plan)
    assert compare_groups(sm90_ptx(twin), sm90_ptx(build), groups, block, follow_copies=True) == []


@pytest.mark.slow
@needs_cutedsl
def test_a_wide_build_pushing_its_partials_swapped_is_seen(monkeypatch):
    """The broken case: a wide warp pushing its two norm partials in the other order (the second four rows' into
    the first's slot) sums the same 32 numbers in another order; the check must see it in the pushes of every
    lane that pushes, and nowhere else."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import Int32

    from harness.ptx_values import compare_groups
    from k3_decode.kernels import kda_step

    @cute.jit
    def swapped(self, o: list, norm_s: cute.Tensor, at: cutlass.Constexpr[int], bars, place):
        plan = self.plan
        partials = [kda_step._dot(o[4 * i :], o[4 * i :], 4) for i in range(2)]
        if place.lane < plan.cluster:
            c = at + place.rank * (plan.rows_per_cta // 4) + 2 * place.warp
            words = (partials[1].bitcast(Int32), partials[0].bitcast(Int32))
            cute.arch.store_async_dsmem(norm_s.iterator + cute.assume(c, divby=2), words, bars + 1, place.lane)

    (build,) = [b for b in WIDE_BUILDS if b.name == "kda_step/tp8/b16/t1536/wide-warps"]
    twin = four_row_twin(build)
    plain = sm90_ptx(twin)
    monkeypatch.setattr(kda_step.KdaStepKernel, "_push_norm", swapped)
    broken = build.compile("sm_90a").ptx
    block = (build.plan.cluster - 1, 1, 1)
    diffs = compare_groups(plain, broken, lane_groups(build.plan, twin.plan), block, follow_copies=True)
    assert {(d.thread, d.space) for d in diffs} == {(0, "async"), (1, "async")}, [str(d) for d in diffs[:3]]
    assert len(diffs) == 2 * 2 * build.plan.warps  # each of lanes 0 and 1 pushes 2 partials a warp to its CTA


@pytest.mark.slow
@needs_cutedsl
def test_a_wide_cta_runs_at_least_a_fifth_fewer_instructions():
    """What wide warps are for (docs/kda-layer-h200.md): a CTA's fixed work per warp paid half as often. At the
    served B16 and B64 plans the wide CTA runs at most 80 % of the four-row CTA's instructions (72-74 % at this
    tree); the broken case, the lean start (the same warps, its copies only moved), runs more than that."""
    for name in (
        "kda_step/tp8/b16/t1536/wide-warps",
        "kda_step/tp16/b64/t1536/wide-warps",
        "kda_step/tp8/b64/lean/wide-warps",
    ):
        (build,) = [b for b in WIDE_BUILDS if b.name == name]
        assert cta_instructions(build) <= 0.8 * cta_instructions(four_row_twin(build)), name
    (lean,) = [b for b in step_builds() if b.name == "kda_step/tp8/b64/lean"]
    plain = KdaStepBuild(8, dataclasses.replace(lean.plan, lean_start=False))
    assert cta_instructions(lean) > 0.8 * cta_instructions(plain)


@pytest.mark.slow
@needs_cutedsl
def test_a_capped_build_is_the_uncapped_builds_code():
    """A cap (KdaStepPlan.max_ctas_per_sm) is the launch's shared-memory request and nothing else where no code reads
    the waves: the PTX must be the uncapped build's, line for line, at TP8 B32 and TP16 B64. The broken case: at
    TP8 B64 the lean start warms L2 only in the grid's first wave, which three CTAs an SM shorten from 22 requests
    to 16; the comparison must see that bound, and only it."""
    capped = {b.name: b for b in WIDE_BUILDS if b.plan.max_ctas_per_sm}
    assert len(capped) == 3
    by_name = {b.name: b for b in WIDE_BUILDS}
    for name, build in capped.items():
        twin = by_name[name.removesuffix("/cap3")]
        assert twin.plan == dataclasses.replace(build.plan, max_ctas_per_sm=0)
        diff = [
            line
            for line in difflib.unified_diff(sm90_ptx(twin).splitlines(), sm90_ptx(build).splitlines(), n=0)
            if line[:1] in "+-" and line[:3] not in ("---", "+++")
        ]
        if build.plan.lean_start:
            first_wave = (twin.plan.wave_requests - 1, build.plan.wave_requests - 1)
            assert first_wave == (21, 15)
            assert [re.sub(r"\s+", " ", d) for d in diff] == [
                f"{sign} setp.gt.u32 %p7, %r5, {n};" for sign, n in zip("-+", first_wave, strict=True)
            ], diff
        else:
            assert diff == [], diff[:4]


def test_wide_warps_and_the_lean_conv_save_more_together_than_either():
    """The two knobs cut different work (a warp's fixed share, and the conv run by every warp), so together a live
    CTA runs at most two thirds of the plain step's instructions at the same plan (61-62 % at this tree), where wide
    warps alone run 72-74 %: the broken case, a combined build that lost its lean conv, fails the bound."""
    # where a CTA has more wide warps than the two conv warps (at clusters of 8 both warps convolve: nothing to skip);
    # the lean start's builds beside the pair for its rounds only move copies, and are left out
    together = [
        b
        for b in WIDE_BUILDS
        if b.plan.lean_conv
        and not b.plan.max_ctas_per_sm
        and b.plan.warps > 2
        and b.plan.lean_start == KdaStepPlan.for_shape(b.plan.heads, b.plan.rows, b.plan.batch).lean_start
    ]
    assert len(together) == 8
    for build in together:
        plain = cta_instructions(four_row_twin(build))
        assert cta_instructions(build) <= 2 / 3 * plain, build.name
        alone = KdaStepBuild(build.tp, dataclasses.replace(build.plan, lean_conv=False))
        assert cta_instructions(alone) > 2 / 3 * plain, build.name
