"""The L2-traffic profile script off the GPU: its ncu report parsing, its totals, its refusals."""

from __future__ import annotations

import csv
import io

import pytest
import torch

from benchmarks import l2_traffic_h200 as l2

# What `ncu --csv --print-units base` prints: its own messages first, then one row per (kernel, metric); values of
# four digits and more carry thousands separators.
HEADER = ["ID", "Process ID", "Process Name", "Host Name", "Kernel Name", "Context", "Stream", "Block Size",
          "Grid Size", "Device", "CC", "Section Name", "Metric Name", "Metric Unit", "Metric Value"]  # fmt: skip
ROWS = [
    ("0", "nvjet_sm90_tst_64x32_splitK", "dram__bytes_read.sum", "byte", "22,020,096"),
    ("0", "nvjet_sm90_tst_64x32_splitK", "gpu__time_duration.sum", "nsecond", "9,376"),
    ("0", "nvjet_sm90_tst_64x32_splitK", "l1tex__m_xbar2l1tex_read_bytes.sum", "byte", "30,000,000"),
    ("0", "nvjet_sm90_tst_64x32_splitK", "lts__t_sectors_srcunit_tex_op_read.sum", "sector", "1,000"),
    ("0", "nvjet_sm90_tst_64x32_splitK", "lts__t_sectors_srcunit_tex_op_read_lookup_hit.sum", "sector", "250"),
    ("0", "nvjet_sm90_tst_64x32_splitK", "lts__throughput.avg.pct_of_peak_sustained_elapsed", "%", "61.5"),
    ("1", "splitKreduce_kernel", "dram__bytes_read.sum", "byte", "1,048,576"),
    ("1", "splitKreduce_kernel", "gpu__time_duration.sum", "nsecond", "1,624"),
    ("1", "splitKreduce_kernel", "l1tex__m_xbar2l1tex_read_bytes.sum", "byte", "2,000,000"),
    ("1", "splitKreduce_kernel", "lts__throughput.avg.pct_of_peak_sustained_elapsed", "%", "12.0"),
    ("1", "splitKreduce_kernel", "dram__throughput.avg.pct_of_peak_sustained_elapsed", "%", "n/a"),
    ("1", "splitKreduce_kernel", "sm__warps_active.avg", "warp", "3"),
]


def report(rows: list[tuple[str, ...]]) -> str:
    text = io.StringIO()
    text.write('==PROF== Connected to process 4242\n==PROF== Profiling "nvjet_sm90_tst_64x32" - 0: 9 passes\n')
    writer = csv.writer(text, quoting=csv.QUOTE_ALL, lineterminator="\n")
    writer.writerow(HEADER)
    for kid, kernel, metric, unit, value in rows:
        writer.writerow([kid, "4242", "python3", "h", kernel, "1", "7", "(128, 1, 1)", "(56, 4, 1)", "0", "9.0",
                         "Command line profiler metrics", metric, unit, value])  # fmt: skip
    text.write("==PROF== Disconnected from process 4242\n")
    return text.getvalue()


REPORT = report(ROWS)


def test_the_report_parses_to_one_entry_per_kernel_in_launch_order():
    kernels = l2.parse_ncu_csv(REPORT)
    assert [k["kernel"] for k in kernels] == ["nvjet_sm90_tst_64x32_splitK", "splitKreduce_kernel"]
    assert kernels[0]["dram_read_bytes"] == 22_020_096 and kernels[0]["duration_ns"] == 9376  # separators gone
    # only the requested metrics, and an "n/a" value left out rather than read as 0
    assert "sm__warps_active.avg" not in kernels[1] and "dram_throughput_pct" not in kernels[1]
    assert len(kernels[1]) == 1 + 4


def test_a_case_sums_its_kernels_and_relates_the_traffic_to_the_weight():
    case = l2.Case("o_proj", "cublas", 8, 32)
    rows, k = l2.shapes(case)
    assert (rows, k) == (7168, 1536)
    r = l2.summarize(case, l2.parse_ncu_csv(REPORT))
    assert r["duration_ns"] == 9376 + 1624 and r["l2_to_sm_bytes"] == 32_000_000
    assert r["weight_bytes"] == 7168 * 1536 * 2 and r["input_bytes"] == 32 * 1536 * 2
    assert r["l2_to_sm_per_weight_byte"] == pytest.approx(32_000_000 / (7168 * 1536 * 2))
    assert r["l2_throughput_pct"] == 61.5  # the busiest kernel's, not a sum of percentages
    assert r["l2_read_hit_rate"] == 0.25 and r["duration_us"] == pytest.approx(11.0)


def test_a_report_without_the_csv_or_the_metrics_is_an_error():
    with pytest.raises(ValueError, match="no ncu CSV report"):
        l2.parse_ncu_csv("==PROF== No kernels were profiled.\n")
    with pytest.raises(ValueError, match="none of the requested metrics"):
        l2.parse_ncu_csv(report([("0", "k", "other.metric", "x", "1")]))


def test_the_cases_cover_both_impls_where_they_part_ways_and_have_unique_names():
    names = [c.name for c in l2.CASES]
    assert len(names) == len(set(names))
    for op, tp, batch in (("o_proj", 8, 64), ("o_proj", 8, 1), ("in_proj", 16, 32)):
        impls = {c.impl for c in l2.CASES if (c.op, c.tp, c.batch) == (op, tp, batch)}
        assert len(impls) == 2 and "cublas" in impls, (op, tp, batch)
    assert l2.shapes(l2.Case("in_proj", "cute", 16, 1)) == (3216, 7168)
    with pytest.raises(SystemExit, match="no case 'o_proj/x/tp8/b1'"):
        l2.case_named("o_proj/x/tp8/b1")


def test_main_refuses_without_cuda_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "r.json"
    assert l2.main(["--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "CUDA" in err and not out.exists()
    with pytest.raises(SystemExit):
        l2.main([])  # --out is required
