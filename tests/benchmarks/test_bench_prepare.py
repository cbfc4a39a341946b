"""`bench`'s data-at-scale section: prepare records/s and peak RSS, training data RSS per rank.
No timing is asserted (a benchmark measures; a test never times)."""

from __future__ import annotations

import math

import numpy as np

from benchmarks.bench import bench_prepare, bench_prepare_generators
from benchmarks.catalogs import GENERATORS


def test_bench_prepare_measures_a_prepare_process_and_a_rank(tmp_path):
    result = bench_prepare(tmp_path, 2_000, "tiny", generators=False)
    assert result["records"] >= 2_000
    for key in ("prepare_records_per_s", "prepare_records_per_cpu_s", "prepare_peak_rss_mb",
                "train_data_rss_mb_per_rank", "train_data_node_rss_growth"):
        assert isinstance(result[key], float) and math.isfinite(result[key]) and result[key] > 0, key
    # Measured with 1 and with 2 training ranks, each in its own process under torchrun.
    assert [r["ranks"] for r in result["train_data_rss_by_ranks"]] == [1, 2]
    assert all(r["node_mb"] >= r["private_mb"] * r["ranks"] for r in result["train_data_rss_by_ranks"])
    assert (tmp_path / "prepare-run" / "prepared" / "prepare.json").is_file()
    # The same upload as an array job: plan, 2 shard children, finish; each phase measured.
    phases = result["prepare_sharded"]
    assert set(phases) == {"plan", "shard", "finish"} and phases["shard"]["children"] == 2
    for phase in phases.values():
        for key in ("wall_s", "cpu_s", "peak_rss_mb"):
            assert isinstance(phase[key], float) and math.isfinite(phase[key]) and phase[key] > 0, key
    assert result["prepare_sharded_peak_rss_mb"] == max(p["peak_rss_mb"] for p in phases.values())
    assert result["prepare_sharded_identical"] is True
    assert (tmp_path / "prepare-sharded-run" / "prepared" / "prepare.json").is_file()


def test_bench_prepare_measures_each_generator_s_upload_in_its_own_process(tmp_path):
    result = bench_prepare_generators(tmp_path, 1_000, "tiny")
    assert set(result["prepare_generators"]) == set(GENERATORS)
    for name, measured in result["prepare_generators"].items():
        assert measured["records"] >= 1_000, name
        for key in ("records_per_s", "records_per_cpu_s", "peak_rss_mb", "wall_s", "cpu_s"):
            assert isinstance(measured[key], float) and math.isfinite(measured[key]) and measured[key] > 0, (name, key)
    assert result["prepare_generators_records_per_s"] == min(g["records_per_s"] for g in result["prepare_generators"].values())
    assert result["prepare_generators_peak_rss_mb"] == max(g["peak_rss_mb"] for g in result["prepare_generators"].values())
    assert list(tmp_path.iterdir()) == []  # each upload and run dir deleted once measured


def test_the_measured_peak_rss_is_the_child_s_own_not_the_parent_s():
    """Linux carries a parent's peak RSS into the rusage of a child it spawns; a small step run
    from a large process must still report its own small peak."""
    from benchmarks.bench import _run_measured

    ballast = np.ones(600 * 2**20, dtype=np.uint8)  # 600 MB resident in this (the parent) process
    _, cpu_s, peak = _run_measured(["--version"])
    assert ballast.sum() == ballast.size
    assert cpu_s > 0
    assert peak < 400 * 2**20


def test_the_measured_memory_counts_the_processes_a_step_starts():
    """prepare's worker processes hold memory of their own: the measured tree holds a grandchild's
    300 MB, not only its parent's."""
    import os
    import signal
    import subprocess
    import sys

    from benchmarks.bench import tree_pss

    code = ("import os, time\n"
            "ready, told = os.pipe()\n"
            "if os.fork() == 0:\n"
            "    ballast = b'x' * (300 * 2**20)\n"
            "    os.write(told, b'1')\n"
            "else:\n"
            "    os.read(ready, 1)\n"
            "    print('ready', flush=True)\n"
            "time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        assert tree_pss(proc.pid) > 300 * 2**20
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
