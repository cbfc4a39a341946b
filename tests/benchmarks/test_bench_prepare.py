"""`bench`'s data-at-scale section: prepare records/s and peak RSS, training data RSS per rank.
No timing is asserted (a benchmark measures; a test never times)."""

from __future__ import annotations

import math

from benchmarks.bench import bench_prepare


def test_bench_prepare_measures_a_prepare_process_and_a_rank(tmp_path):
    result = bench_prepare(tmp_path, 2_000, "tiny")
    assert result["records"] >= 2_000
    for key in ("prepare_records_per_s", "prepare_records_per_cpu_s", "prepare_peak_rss_mb",
                "train_data_rss_mb_per_rank"):
        assert isinstance(result[key], float) and math.isfinite(result[key]) and result[key] > 0, key
    assert (tmp_path / "prepare-run" / "prepared" / "prepare.json").is_file()
