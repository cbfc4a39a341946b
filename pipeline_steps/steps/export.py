"""export: the trained towers as sentence-transformers folders that serving stacks load.

Writes OUT/query/, OUT/product/ (only for a model without explicit product features) and
OUT/export.json from a checkpoint (a .pt file or a run dir); OUT is replaced as a whole.
`--s3-uri` also uploads OUT (the marker _SUCCESS last); `--run-dir` closes the pipeline's MLflow run.
Folder layout, publishing and exit codes: docs/training.md, "Exporting the model".

Local:  python -m pipeline_steps export --checkpoint runs/demo --out runs/demo/export
AWS:    job "export" after Embed: python -m pipeline_steps export --run-dir /fsx/runs/<run_id>
        --checkpoint /fsx/runs/<run_id> --out /fsx/runs/<run_id>/export --s3-uri s3://<artifacts>/runs/<run_id>/export/
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

from pipeline_contract import GATE_REPORT

from .. import tracking
from ..errors import BadConfigError
from ..fileio import read_json
from ..sentence_transformers_export import export, upload

log = logging.getLogger("pipeline_steps.export")


def finish_pipeline_run(run_dir: Path, report: dict[str, Any], out: Path, s3_uri: str | None) -> None:
    """The export's child run, then the pipeline's MLflow run closed as FINISHED with the gate's
    metrics (GATE_REPORT): on AWS the export is the last Batch job of a run that passed
    the gate. Tracking never fails the step."""
    gate_path = Path(run_dir) / GATE_REPORT
    metrics = (read_json(gate_path).get("metrics") or {}) if gate_path.is_file() else {}
    tracking.log_step("export", Path(run_dir), params={
        "checkpoint": report["checkpoint"], "checkpoint_sha256": report["checkpoint_sha256"],
        "towers": ",".join(report["towers"]), "out": str(out), "s3_uri": s3_uri})
    tracking.log_pipeline(Path(run_dir), metrics=metrics, status="FINISHED", tags={tracking.OUTCOME_TAG: "exported"})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline_steps export", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, type=Path,
                        help="a checkpoint .pt, or a run dir (its newest valid checkpoint)")
    parser.add_argument("--out", required=True, type=Path, help="output directory (replaced)")
    parser.add_argument("--s3-uri", metavar="s3://BUCKET/PREFIX/",
                        help="also upload OUT there (files first, the marker _SUCCESS last)")
    parser.add_argument("--run-dir", type=Path,
                        help="the pipeline run this export ends: log it and close the run's MLflow run")
    args = parser.parse_args(argv)
    if args.s3_uri:
        _check_s3_prefix(args.s3_uri)
    report = export(args.checkpoint, args.out)
    log.info("exported %s (step %s) to %s: %s; %s", report["checkpoint"], report["step"], args.out,
             ", ".join(report["towers"]), report["product_tower"])
    if args.s3_uri:
        # Uploaded here, not left to the FSx auto-export to S3, which is asynchronous: with the marker
        # last, the published pointer names a complete export as soon as the job succeeded.
        upload(args.out, args.s3_uri)
    if args.run_dir is not None:
        finish_pipeline_run(args.run_dir, report, args.out, args.s3_uri)
    return 0


def _check_s3_prefix(uri: str) -> None:
    # Checked before the export, so a typo costs seconds, not a model load.
    if not uri.startswith("s3://") or not uri[len("s3://"):].partition("/")[0]:
        raise BadConfigError(f"--s3-uri {uri!r}: expected s3://bucket/prefix/ (e.g. "
                             "s3://my-artifacts/runs/<run_id>/export/)")
