"""The head-stream probe's benchmark off the GPU: its refusals, and its tables from a results file."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import head_stream_h200 as hs


def results() -> dict:
    """A results file as run_cell writes it, for one cell, with numbers chosen here."""
    timeline = {
        "end_us": 21.5,
        "start_spread_us": 0.4,
        "stream_pct_of_copy": 97.6,
        "group_first_us": [1.0, 2.0, 3.5, 5.0],
        "group_done_us": [2.25, 7.5, 14.0, 21.5],
        "trip_median_us": [3.0, 6.0, 9.0],
    }
    head = {
        "split": 2,
        "watch": False,
        "ctas": 262,
        "trips": 6,
        "us": 22.75,
        "us_rounds": [22.75] * 3,
        "pct_of_copy": 94.3,
        "time_vs_served": {"median": 0.982, "min": 0.951, "max": 1.004},
        "timeline": timeline,
    }
    watched = {
        **head,
        "watch": True,
        "us": 23.0,
        "pct_of_copy": 93.3,
        "time_vs_served": {"median": 0.996, "min": 0.97, "max": 1.02},
        "timeline": {
            **timeline,
            "seen_first_us": [2.5, 7.75, 14.25, 21.75],
            "seen_median_us": [2.75, 8.0, 14.5, 22.0],  # 0.5 us after each group's last row
            "seen_last_us": [3.25, 8.25, 14.75, 23.5],  # the latest: 2 us after the last head
        },
    }
    ring = {
        **head,
        "split": 4,
        "stages": 3,
        "us": 21.9,
        "pct_of_copy": 97.9,
        "time_vs_served": {"median": 0.948, "min": 0.93, "max": 0.97},
    }
    return {
        "env": {"gpu": "NVIDIA H200", "commit": "0123456789abcdef", "dirty": False},
        "copy_bandwidth_bytes_per_s": 4.19e12,
        "calls_per_graph": 12,
        "rounds": 3,
        "cells": [
            {
                "tp": 8,
                "batch": 1,
                "rows": 6288,
                "bytes": 90_000_000,
                "weight_copies": 2,
                "served": {"kernel": "tensor_core", "us": 23.1, "us_rounds": [23.1] * 3, "pct_of_copy": 93.0},
                "served_timeline": {"end_us": 21.75, "stream_pct_of_copy": 98.8},
                "cuda_core": {"us": 24.2, "us_rounds": [24.2] * 3, "pct_of_copy": 88.8},
                "head_stream": [head, watched, ring],
            }
        ],
    }


def test_the_tables_show_each_arm_and_each_launch_timeline(tmp_path, capsys):
    """The served build named, the CUDA-core stream beside it where it is not the one served, every head-stream arm
    against the served build, and each arm's isolated launch."""
    path = tmp_path / "r.json"
    path.write_text(json.dumps(results()))
    assert hs.main(["--table", str(path)]) == 0
    out = capsys.readouterr().out
    assert "NVIDIA H200, commit 0123456; copy bandwidth 4.19 TB/s; 12 calls a graph, 3 rounds." in out
    assert "| TP | B | served build | CUDA-core stream | split 2 | split 2, watched | split 4, ring of 3 |" in out
    assert (
        "| 8 | 1 | tensor_core: 23.10 us (93 %) | 24.20 us (89 %) | 22.75 us (94 %), x0.982 [0.951, 1.004] | "
        "23.00 us (93 %), x0.996 [0.970, 1.020] | 21.90 us (98 %), x0.948 [0.930, 0.970] |"
    ) in out
    served = "| 8 | 1 | 21.75 us (99 %) |"
    assert f"{served} split 4, ring of 3 | 21.50 us (98 %) |" in out
    assert f"{served} split 2 | 21.50 us (98 %) | 2.25 us | 7.50, 14.00, 21.50 us | - |" in out
    assert (
        f"{served} split 2, watched | 21.50 us (98 %) | 2.25 us | 7.50, 14.00, 21.50 us | 0.50 us, latest 2.00 us |"
        in out
    )


def test_a_file_that_is_not_results_is_one_line_of_error(tmp_path, capsys):
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"cells": []}))
    assert hs.main(["--table", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("head_stream_h200.py: cannot read") and "\n" not in err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--out", "x.json", "--batches", "9"], "--batches takes 1..8"),
        (["--out", "x.json", "--rounds", "2"], "--rounds must be at least 3"),
        (["--out", "x.json", "--tp", "7"], "--tp 7"),
        ([], "--out is required"),
    ],
)
def test_bad_arguments_are_refused_before_any_device_work(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        hs.main(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the script would run")
def test_without_a_gpu_the_script_says_so_in_one_line(tmp_path, capsys):
    assert hs.main(["--out", str(tmp_path / "r.json"), "--tp", "16", "--batches", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "head_stream_h200.py: no CUDA device here; run it on the GPU machine (an H200)"
    assert not (tmp_path / "r.json").exists()


def test_where_the_cuda_core_stream_is_the_served_build_it_is_not_shown_twice(tmp_path, capsys):
    """And a cell without an arm another cell has (the ring is built at B1 only) shows "-" there."""
    r = results()
    r["cells"][0]["served"]["kernel"], r["cells"][0]["cuda_core"] = "cuda_core", None
    r["cells"].append({**r["cells"][0], "batch": 4, "head_stream": r["cells"][0]["head_stream"][:1]})
    path = tmp_path / "r.json"
    path.write_text(json.dumps(r))
    assert hs.main(["--table", str(path)]) == 0
    out = capsys.readouterr().out
    assert "| 8 | 1 | cuda_core: 23.10 us (93 %) | served | 22.75 us (94 %)" in out
    assert "| 8 | 4 | cuda_core: 23.10 us (93 %) | served | 22.75 us (94 %), x0.982 [0.951, 1.004] | - | - |" in out
