"""Step `run-local`: the whole pipeline on this machine, each step its own process as on AWS Batch.

    prepare -> sanity (2 gloo processes) -> compile -> train -> validate (+ gate) -> embed

Input: --data (the upload layout) or the bundled demo data; multi-rank steps run under torchrun.
Writes every step's outputs under DIR and DIR/report.json. Stops at the first failing step with its
exit code (a failed gate stops before embed, as on AWS); exit 78 for a run dir of another preset or backend.

Local:  python -m pipeline_steps run-local --run-dir runs/demo-small-cpu --preset small --backend cpu
BERT:   python -m pipeline_steps run-local --run-dir runs/minilm --preset small --pretrained models/all-MiniLM-L6-v2
XLA:    PJRT_DEVICE=CPU python -m pipeline_steps run-local --run-dir runs/xla --preset tiny --backend xla
AWS:    the state machine runs the same step commands as Batch jobs (docs/orchestration.md).
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import cost, tracking
from .contract import (COMPILE_REPORT, EMBEDDINGS_DIR, EMBEDDINGS_MANIFEST, GATE_REPORT, TRAIN_SUMMARY,
                       VALIDATION_METRICS)
from .errors import BadConfigError, ExitCode
from .fileio import atomic_write_json, read_json

log = logging.getLogger(__name__)


@dataclass
class StepRun:
    name: str
    command: list[str]
    status: str = "pending"
    seconds: float = 0.0
    exit_code: int | None = None
    detail: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "status": self.status, "seconds": round(self.seconds, 3),
                "exit_code": self.exit_code, "command": self.command, **self.detail}


RUN_IDENTITY = "run-local.json"


def claim_run_dir(run_dir: Path, preset: str, backend: str, pretrained: Path | None = None) -> None:
    """Refuse a run dir that holds another preset's, backend's or starting encoder's run, before
    any step starts.

    Every step resumes or skips what its run dir already holds, so a second run with another
    preset (or from another pretrained encoder, or none) would find the first one's checkpoint
    (train exits 78 on the model shape) and one with another backend would skip training
    altogether. The first run-local writes DIR/run-local.json; runs made before it existed are
    recognised by their report.json.
    """
    start = str(pretrained.resolve()) if pretrained else None
    for name in (RUN_IDENTITY, "report.json"):
        previous = _maybe(run_dir / name)
        if previous is None:
            continue
        theirs = (previous.get("preset"), previous.get("backend"))
        if theirs != (preset, backend):
            raise BadConfigError(
                f"{run_dir} holds a run of preset {theirs[0]!r} on backend {theirs[1]!r}, not {preset!r} on "
                f"{backend!r}; pass another --run-dir (e.g. runs/demo-{preset}-{backend}; `make demo` picks "
                "one per preset and backend) or delete the old one")
        if previous.get("pretrained") != start:
            raise BadConfigError(
                f"{run_dir} holds a run that started from {previous.get('pretrained') or 'scratch'}, not from "
                f"{start or 'scratch'}; pass another --run-dir or delete the old one")
        break
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(run_dir / RUN_IDENTITY, {"preset": preset, "backend": backend, "pretrained": start})


def _python_step(step: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "pipeline_steps", step, *args]


def _torchrun_step(nproc: int, step: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            "-m", "pipeline_steps", step, *args]


def plan(args: argparse.Namespace) -> list[StepRun]:
    run_dir, preset, backend = str(args.run_dir), args.preset, args.backend
    common = ["--run-dir", run_dir]
    source = ["--data", str(args.data)] if args.data else ["--demo"]
    init = ["--init-from", str(args.init_from)] if args.init_from else []
    start = ["--pretrained", str(args.pretrained)] if args.pretrained else []
    train_args = [*common, "--preset", preset, "--backend", backend, "--no-progress", *init]
    if args.max_steps is not None:
        train_args += ["--max-steps", str(args.max_steps)]
    if backend == "xla":
        train = _python_step("train", *train_args)  # torch-xla's CPU client is single-process
    else:
        train = _torchrun_step(args.nproc, "train", *train_args)
    validate = _python_step("validate", *common, "--backend", "cpu",
                            *(["--previous-metrics", str(args.previous_metrics)] if args.previous_metrics else []))
    steps = [
        StepRun("prepare", _python_step("prepare", *common, *source, "--preset", preset, *init, *start)),
        StepRun("sanity", _torchrun_step(args.nproc, "sanity", *common, "--backend", "cpu")),
        StepRun("compile", _python_step("compile", *train_args)),
        StepRun("train", train),
        StepRun("validate", validate),
    ]
    steps += [StepRun(f"embed[{i}]", _python_step("embed", *common, "--backend", "cpu", "--shard-index", str(i),
                                                  "--shard-count", str(args.embed_shards)))
              for i in range(args.embed_shards)]
    return steps


def run_step(step: StepRun, env: dict[str, str]) -> None:
    log.info("== %s: %s", step.name, " ".join(step.command[1:]))
    started = time.monotonic()
    result = subprocess.run(step.command, env=env, check=False)
    step.seconds, step.exit_code = time.monotonic() - started, result.returncode
    step.status = "passed" if result.returncode == 0 else (
        "gate_failed" if result.returncode == ExitCode.GATE_FAILED else "failed")


def _maybe(path: Path) -> Any:
    return read_json(path) if path.exists() else None


def build_report(run_dir: Path, steps: list[StepRun], backend: str, preset: str) -> dict[str, Any]:
    """DIR/report.json: steps[{name, status, seconds, exit_code, command}], train{...}, validation{metrics,
    baseline, gate}, embeddings{count, path}, xla{graphs_compiled, compiles_after_warmup, ...} (xla
    backend); main adds cost and mlflow."""
    metrics = _maybe(run_dir / VALIDATION_METRICS) or {}
    gate = _maybe(run_dir / GATE_REPORT) or {}
    train = _maybe(run_dir / TRAIN_SUMMARY) or {}
    manifest = _maybe(run_dir / EMBEDDINGS_DIR / EMBEDDINGS_MANIFEST)
    report: dict[str, Any] = {
        "run_dir": str(run_dir), "backend": backend, "preset": preset,
        "passed": all(s.status == "passed" for s in steps),
        "steps": [s.as_dict() for s in steps],
        "train": {k: train.get(k) for k in ("steps", "seconds", "final_loss", "holdout_loss", "tokens_per_s",
                                             "parameters", "checkpoint", "world_size")},
        "validation": {"metrics": metrics.get("metrics", gate.get("metrics")),
                       "baseline": metrics.get("baseline", gate.get("baseline")),
                       "gate": {"passed": gate.get("passed"), "reasons": gate.get("reasons")}},
        "embeddings": {"count": manifest.get("total_count") if manifest else None,
                       "path": str(run_dir / EMBEDDINGS_DIR) if manifest else None},
    }
    if backend == "xla":
        xla = train.get("xla") or {}
        compile_report = _maybe(run_dir / COMPILE_REPORT) or {}
        report["xla"] = {"graphs_compiled": xla.get("graphs_compiled"),
                         "compiles_after_warmup": xla.get("compiles_after_warmup"),
                         "graphs_not_in_compile_cache": xla.get("graphs_not_in_compile_cache"),
                         "compile_step_graphs": compile_report.get("graphs_compiled")}
    return report


def _fmt(value: Any) -> str:
    return "-" if value is None else f"{value:.4f}"


def print_summary(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(stderr=True)
    steps = Table(title=f"run-local ({report['preset']}, {report['backend']})")
    for col in ("step", "status", "seconds"):
        steps.add_column(col)
    for s in report["steps"]:
        colour = "green" if s["status"] == "passed" else "red"
        steps.add_row(s["name"], f"[{colour}]{s['status']}[/{colour}]", f"{s['seconds']:.1f}")
    console.print(steps)
    metrics, baseline = report["validation"]["metrics"] or {}, report["validation"]["baseline"] or {}
    if metrics:
        table = Table(title="holdout retrieval: model vs BM25")
        for col in ("metric", "model", "bm25"):
            table.add_column(col)
        for key in sorted(metrics):
            table.add_row(key, _fmt(metrics[key]), _fmt(baseline.get(key)))
        console.print(table)
    gate = report["validation"]["gate"]
    verdict = {True: "PASSED", False: "FAILED", None: "not run"}[gate["passed"]]
    console.print(f"quality gate: {verdict}")
    for reason in gate.get("reasons") or []:
        console.print(f"  {reason}")
    if report["embeddings"]["count"] is not None:
        console.print(f"embeddings: {report['embeddings']['count']} products -> {report['embeddings']['path']}")
    if "xla" in report:
        console.print(f"xla: {report['xla']['graphs_compiled']} graphs compiled in training, "
                      f"{report['xla']['compiles_after_warmup']} after warm-up")
    console.print(f"report: {report['run_dir']}/report.json")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline_steps run-local", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run-dir", required=True, type=Path)
    parser.add_argument("--preset", default="small", choices=("tiny", "small", "base", "large"))
    parser.add_argument("--backend", default="cpu", choices=("cpu", "xla"))
    parser.add_argument("--data", type=Path, default=None, help="input in the upload layout (default: demo data)")
    parser.add_argument("--init-from", type=Path, default=None, help="incremental: previous run dir or checkpoint")
    parser.add_argument("--pretrained", type=Path, default=None,
                        help="start the encoder from this local Hugging Face BERT directory (docs/training.md)")
    parser.add_argument("--previous-metrics", type=Path, default=None,
                        help="the production model's gate.json/metrics.json for the quality gate")
    parser.add_argument("--nproc", type=int, default=2, help="processes for sanity and eager DDP training")
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--embed-shards", type=int, default=2, help="embed shards (array children on AWS)")
    args = parser.parse_args(argv)
    claim_run_dir(args.run_dir, args.preset, args.backend, args.pretrained)
    env = dict(os.environ)
    if args.backend == "xla":
        env.setdefault("PJRT_DEVICE", "CPU")

    steps = plan(args)
    code = 0
    for step in steps:
        run_step(step, env)
        if step.exit_code:
            code = step.exit_code
            for later in steps[steps.index(step) + 1:]:
                later.status = "not_run"
            break
    report = build_report(args.run_dir, steps, args.backend, args.preset)
    report["pretrained"] = str(args.pretrained.resolve()) if args.pretrained else None
    # ---- cost + tracking: the same cost fields as on AWS (compute price 0 here, durations real);
    # the run-wide outcome on the parent MLflow run in DIR/mlruns (never fails the run)
    report["cost"] = cost.local_cost([(s.name, s.seconds) for s in steps])
    report["mlflow"] = {"tracking_uri": tracking.tracking_uri(args.run_dir), "run_id": tracking.log_pipeline(
        args.run_dir, params={"preset": args.preset, "backend": args.backend, "pretrained": report["pretrained"]},
        metrics={**(report["validation"]["metrics"] or {}), "cost_usd": report["cost"]["total_usd"],
                 "seconds": report["cost"]["seconds"]},
        status="FINISHED" if report["passed"] else "FAILED", report=report)}
    atomic_write_json(args.run_dir / "report.json", report)
    print_summary(report)
    return code
