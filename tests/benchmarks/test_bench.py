"""`python -m benchmarks.bench`: runs end to end and writes the documented keys. No timing is asserted
(a benchmark measures; a test never times)."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

from torch import nn

import numpy as np

from benchmarks.bench import Shape, embed_flops, matmul_params, train_step_flops
from pipeline_steps.config import get_preset
from pipeline_steps.fileio import read_json
from pipeline_steps.model import TextEncoder

from tests.steps.conftest import REPO, cli_env

DOCUMENTED_KEYS = {"train_ratio_vs_peer", "embed_ratio_vs_peer", "embed_mfu_vs_ceiling", "embed_by_preset",
                   "loader_headroom", "compiles_after_warmup", "graphs_compiled", "mfu_vs_ceiling",
                   "mfu_vs_ceiling_by_preset", "checkpoint_save_s_per_gb", "checkpoint_load_s_per_gb", "machine",
                   "xla_train_ratio_vs_peer", "xla_host_s_per_step", "xla_tokens_per_s", "xla_bf16_tokens_per_s",
                   "xla_bf16_vs_fp32"}


def test_quick_tiny_bench_writes_every_documented_key(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    result = subprocess.run([sys.executable, "-m", "benchmarks.bench", "--quick", "--presets", "tiny",
                             "--backends", "cpu", "--repeats", "1", "--work-dir", str(tmp_path), "--out", str(out)],
                            env=cli_env(), capture_output=True, text=True, timeout=600, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    report = read_json(out)
    assert DOCUMENTED_KEYS <= set(report)
    for key in ("train_ratio_vs_peer", "embed_ratio_vs_peer", "embed_mfu_vs_ceiling", "loader_headroom",
                "mfu_vs_ceiling", "checkpoint_save_s_per_gb", "checkpoint_load_s_per_gb"):
        assert isinstance(report[key], float) and math.isfinite(report[key]) and report[key] > 0, key
    assert set(report["mfu_vs_ceiling_by_preset"]) == {"tiny"}
    assert report["compiles_after_warmup"] is None  # no xla backend asked for
    assert report["xla_train_ratio_vs_peer"] is report["xla_host_s_per_step"] is report["xla_bf16_vs_fp32"] is None
    assert set(report["embed_by_preset"]) == {"tiny"}
    assert set(report["embed_by_preset"]["tiny"]["backends"]) == {"cpu"}
    assert {"cpu", "logical_cpus", "torch_threads", "torch"} <= set(report["machine"])
    assert "ratio vs peer" in result.stdout  # the table
    assert list(tmp_path.glob("bench-*")) == []  # temporary run dirs removed


def test_flop_formula_counts_every_encoder_matmul_weight() -> None:
    cfg = get_preset("tiny").model
    encoder = TextEncoder(cfg)
    linear_weights = sum(m.weight.numel() for m in encoder.modules() if isinstance(m, nn.Linear))
    assert matmul_params(cfg) == linear_weights
    shape = Shape(batch=4, query_length=8, doc_length=16)
    dense = 6 * linear_weights * 4 * (8 + 16)
    attention = 12 * cfg.num_layers * cfg.hidden_size * 4 * (8**2 + 16**2)
    assert train_step_flops(cfg, shape, heads=False) == dense + attention


def test_embed_flops_count_real_tokens_only() -> None:
    cfg = get_preset("tiny").model
    lengths = np.array([3, 7])
    per_text = [2 * matmul_params(cfg) * n + 4 * cfg.num_layers * cfg.hidden_size * n**2 for n in lengths]
    assert embed_flops(cfg, lengths) == sum(per_text)
