"""The ETTR benchmark's model: the Young and Daly intervals, the MTTF line through Meta's figures, ETTR's shape."""

from __future__ import annotations

import json
import math
import os
import sys

import pytest

from procs import ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import bench_ettr  # noqa: E402


def test_young_interval_is_sqrt_of_twice_stall_times_mttf():
    for delta, mttf in ((0.04, 6480.0), (1.0, 3600.0), (30.0, 28440.0)):
        assert bench_ettr.young_interval(delta, mttf) == pytest.approx(math.sqrt(2 * delta * mttf), rel=1e-12)
    assert bench_ettr.young_interval(0.0, 3600.0) == 0.0


def test_daly_interval_approaches_young_for_small_stalls_and_is_the_mttf_past_twice_it():
    young, daly = bench_ettr.young_interval(0.04, 6480.0), bench_ettr.daly_interval(0.04, 6480.0)
    assert daly == pytest.approx(young, rel=1e-2) and daly < young  # the -delta term dominates for a small stall
    assert bench_ettr.daly_interval(100.0, 3600.0) == pytest.approx(
        math.sqrt(7.2e5) * (1 + math.sqrt(100 / 7200) / 3 + 100 / 7200 / 9) - 100)
    assert bench_ettr.daly_interval(8000.0, 3600.0) == 3600.0


def test_mttf_line_goes_through_both_meta_points_and_falls_with_job_size():
    assert bench_ettr.mttf_at(1024) == pytest.approx(7.9, rel=1e-12)
    assert bench_ettr.mttf_at(16384) == pytest.approx(1.8, rel=1e-12)
    _, _, k = bench_ettr.mttf_fit()
    assert k == pytest.approx(math.log(7.9 / 1.8) / math.log(16), rel=1e-12)
    sizes = [256, 1024, 4096, 16384, 65536]
    mttf = [bench_ettr.mttf_at(n) for n in sizes]
    assert all(a > b for a, b in zip(mttf, mttf[1:]))
    assert 1.8 < bench_ettr.mttf_at(4096) < 7.9
    with pytest.raises(ValueError):
        bench_ettr.mttf_fit(((1024, 7.9), (1024, 1.8)))


def test_ettr_falls_as_restart_cost_grows_and_is_clamped_at_zero():
    mttf, delta = 1.8 * 3600, 0.04
    tau = bench_ettr.young_interval(delta, mttf)
    values = [bench_ettr.ettr(tau, delta, r, mttf) for r in (0.0, 1.0, 10.0, 120.0, 1000.0)]
    assert all(a > b for a, b in zip(values, values[1:]))
    assert values[0] == pytest.approx(tau / (tau + delta) * (1 - (tau + delta) / 2 / mttf))
    assert bench_ettr.ettr(tau, delta, 2 * mttf, mttf) == 0.0
    assert bench_ettr.ettr(0.0, 0.0, 60.0, 3600.0) == pytest.approx(1 - 60 / 3600)


def test_young_interval_maximises_the_first_order_ettr():
    mttf, delta, r = 3600.0, 2.0, 30.0
    best = bench_ettr.young_interval(delta, mttf)
    at = bench_ettr.ettr(best, delta, r, mttf)
    assert at >= bench_ettr.ettr(best * 0.5, delta, r, mttf) and at >= bench_ettr.ettr(best * 2, delta, r, mttf)


def test_s3_restore_is_bounded_by_the_job_bytes_over_aggregate_bandwidth():
    assert bench_ettr.s3_restore(11.6, 256, 1.0, 1000.0) == 11.6
    assert bench_ettr.s3_restore(11.6, 65536, 1.0, 1000.0) == pytest.approx(65536 * 2**30 / 1e12)
    assert bench_ettr.s3_restore(11.6, 65536, 1.0, 0.0) == 11.6


def test_model_gives_one_point_per_method_and_size_and_memory_beats_s3():
    pts = bench_ettr.model(bench_ettr.METHODS, bench_ettr.DEFAULT_STALL, bench_ettr.DEFAULT_RESTORE, 2.0,
                           [1024, 16384], s3_aggregate_gbps=1000.0)
    assert len(pts) == 2 * len(bench_ettr.METHODS)
    by = {(p.method, p.gpus): p for p in pts}
    for n in (1024, 16384):
        assert by[("tierckpt_memory", n)].ettr > by[("tierckpt_s3", n)].ettr
        assert by[("tierckpt_memory", n)].restart == pytest.approx(2.0 + bench_ettr.DEFAULT_RESTORE["memory"])
    assert by[("tierckpt_memory", 1024)].ettr > by[("tierckpt_memory", 16384)].ettr


def test_figures_parse_from_flags_and_from_a_bench_save_file(tmp_path):
    assert bench_ettr.parse_figures("memory=0.2, s3=9", "--restore", bench_ettr.DEFAULT_RESTORE) == {
        "memory": 0.2, "s3": 9.0}
    with pytest.raises(ValueError):
        bench_ettr.parse_figures("tape=1", "--restore", bench_ettr.DEFAULT_RESTORE)
    assert bench_ettr.parse_mttf("1024=7.9,16384=1.8") == ((1024.0, 7.9), (16384.0, 1.8))
    path = tmp_path / "save.json"
    path.write_text(json.dumps({"machine": {"state_gib": 0.25},
                                "methods": {"tierckpt": {"stall": [0.05, 0.01, 0.03]}, "dcp_async": {"stall": [0.2]},
                                            "bound": {"stall": [0.001]}}}))
    stall, restore, gib = bench_ettr.figures_from_json(str(path))
    assert stall == {"tierckpt": 0.03, "dcp_async": 0.2} and restore == {} and gib == 0.25
