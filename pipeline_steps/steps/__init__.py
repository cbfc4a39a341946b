"""The CLI's steps, one thin module each: argument parsing and a `main(argv)` over the library
modules of pipeline_steps. `python -m pipeline_steps <step>` runs `pipeline_steps.steps.<step>.main`.
The pipeline's steps are the commands of the step table (pipeline_contract.PIPELINE_STEPS), in its
order; the tools run on a workstation, never as a Batch job."""

from __future__ import annotations

SUMMARIES: dict[str, str] = {
    "prepare": "validate records, train the tokenizer, write static-shape shards + holdout"
               " (--phase plan|shard|finish: as an array job)",
    "sanity": "device and collective health checks (run before spending trn1 hours)",
    "compile": "ahead-of-time compile: trace every training graph once",
    "train": "DDP / XLA training with resumable, portable checkpoints",
    "validate": "holdout metrics, BM25 baseline and the quality gate",
    "embed": "sharded batch inference of the catalog to Parquet",
    "export": "the towers as sentence-transformers folders for serving",
    "run-local": "the whole chain on this machine (demo data by default)",
    "parity": "train two backends over several seeds; compare metric means and spread",
    "diagnose": "why a job failed: class, evidence and a fix from its node logs",
}
"""What `python -m pipeline_steps --help` says of each step."""
TOOLS = ("run-local", "parity", "diagnose")


def module_name(step: str) -> str:
    """The module of a step: "run-local" -> pipeline_steps.steps.run_local."""
    return f"{__name__}.{step.replace('-', '_')}"
