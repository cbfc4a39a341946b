"""Where things live: the FSx for Lustre paths, the bucket prefixes, one team's layout, the upload
marker and the run directory's files (what a step writes and a later step, the state machine or an
operator reads)."""

from __future__ import annotations

from dataclasses import dataclass

# ---- FSx for Lustre paths and bucket prefixes --------------------------------------------------

FSX_MOUNT_POINT = "/fsx"
"""Where the user data mounts FSx on every node and the job definitions bind-mount it."""
FSX_DATA = f"{FSX_MOUNT_POINT}/data"
"""Linked to the data bucket's root (FSx data repository association); the steps read input here."""
FSX_RUNS = f"{FSX_MOUNT_POINT}/runs"
"""Linked to the artifacts bucket's RUNS_PREFIX; every run's directory is FSX_RUNS/<run id>."""
FSX_CANARY = f"{FSX_MOUNT_POINT}/canary"
"""The canary's run directories: on FSx, outside the exported FSX_RUNS."""
RUNS_PREFIX = "runs/"
"""Key prefix in the artifacts bucket that FSX_RUNS is linked to (the state machine reads it)."""
INCOMING_PREFIX = "incoming/"
"""Key prefix of uploads in the data bucket (PipelineConfig.incoming_prefix's default)."""
FSX_INCOMING = f"{FSX_DATA}/{INCOMING_PREFIX.rstrip('/')}"
"""Uploads as the steps see them: FSX_INCOMING/<dataset>/<version>."""
MODELS_PREFIX = "models/"
"""Key prefix of the published model pointers in the artifacts bucket (TeamPaths.current_model_key)."""
SUCCESS_MARKER = "_SUCCESS"
"""The object a data owner uploads last: <incoming prefix><dataset>/<version>/<this> starts a run
(PipelineConfig.success_marker's default; a stage that configures another one gives its jobs
SUCCESS_MARKER_ENV, and prepare waits for that name)."""


@dataclass(frozen=True)
class TeamPaths:
    """Where one team's uploads, runs and published model live. `team` None is the one default team
    of a stage without teams: incoming/, runs/, models/current.json, as before teams existed. A
    named team has the same layout with `<team>/` after each top-level prefix, in the same buckets
    and FSx trees (the file system's two data repository associations link whole prefixes)."""

    team: str | None = None

    def _within(self, prefix: str) -> str:
        return f"{prefix}{self.team}/" if self.team else prefix

    @property
    def incoming_prefix(self) -> str:
        """Data bucket prefix of the team's uploads: <this><dataset>/<version>/_SUCCESS starts a run."""
        return self._within(INCOMING_PREFIX)

    @property
    def runs_prefix(self) -> str:
        """Artifacts bucket prefix of the team's runs (linked to fsx_runs)."""
        return self._within(RUNS_PREFIX)

    @property
    def models_prefix(self) -> str:
        return self._within(MODELS_PREFIX)

    @property
    def current_model_key(self) -> str:
        """The team's published model pointer in the artifacts bucket (written by Publish only)."""
        return self.models_prefix + "current.json"

    @property
    def fsx_incoming(self) -> str:
        return f"{FSX_INCOMING}/{self.team}" if self.team else FSX_INCOMING

    @property
    def fsx_runs(self) -> str:
        """The team's runs directory on FSx: its project quota's directory."""
        return f"{FSX_RUNS}/{self.team}" if self.team else FSX_RUNS

    def run_id(self, execution_name: str) -> str:
        """The run id of the team's execution: `<team>/<name>`, so run_path/run_key land in the
        team's directories and two teams' runs of the same name never share a heartbeat series."""
        return f"{self.team}/{execution_name}" if self.team else execution_name


# ---- The run directory ---------------------------------------------------------------------------
# Paths inside one run directory (FSX_RUNS/<run id> on AWS, any DIR locally), relative to it: what a
# step writes and a later step, the state machine or an operator reads. The artifacts bucket holds
# them under RUNS_PREFIX<run id>/ (FSx auto-export; validate and export also upload theirs).

PREPARED_DIR = "prepared"
"""prepare's outputs (tokenizer, catalog, pairs): every later step reads them."""
PREPARE_REPORT = f"{PREPARED_DIR}/prepare.json"
"""Written last by prepare; its status "ok" marks a complete set."""
COMPILE_DIR = "compile"
COMPILE_REPORT = f"{COMPILE_DIR}/compile.json"
"""compile's report (graphs traced, shapes); run-local reads it."""
COMPILE_CACHE_DIR = f"{COMPILE_DIR}/xla_cache"
"""The graphs compile traces and train (backend xla) reuses."""
CHECKPOINTS_DIR = "checkpoints"
"""train's step-<n>.pt + manifests; the published pointer's checkpoint_s3_uri is its S3 copy."""
TRAIN_DIR = "train"
TRAIN_METRICS = f"{TRAIN_DIR}/metrics.jsonl"
"""One line per optimizer step; train's MLflow curves come from it."""
TRAIN_SUMMARY = f"{TRAIN_DIR}/summary.json"
"""train's final numbers (loss, tokens/s, checkpoint); run-local and parity read it."""
VALIDATION_DIR = "validation"
VALIDATION_METRICS = f"{VALIDATION_DIR}/metrics.json"
"""validate's metrics: the next run's --previous-metrics once this run's model is published."""
GATE_REPORT = f"{VALIDATION_DIR}/gate.json"
"""validate's gate decision; the state machine reads its S3 copy (run_key(run id, GATE_REPORT))."""
EMBEDDINGS_DIR = "embeddings"
"""embed's parquet shards and manifest; the published pointer's embeddings_uri."""
EMBEDDINGS_MANIFEST = "manifest.json"
"""In embed's output directory (EMBEDDINGS_DIR unless --out), written once every shard is done."""
EXPORT_DIR = "export"
"""export's sentence-transformers folders; uploaded to run_key(run id, EXPORT_DIR) + "/"."""


def run_path(run_id: str, *parts: str) -> str:
    """FSX_RUNS/<run_id>[/parts]: a run directory, or a path in it, as the Batch jobs see it.
    `run_id` may be a placeholder: "Ref::run_id" (job definitions), "{}" (States.Format)."""
    return "/".join((FSX_RUNS, run_id, *parts))


def run_key(run_id: str, *parts: str) -> str:
    """RUNS_PREFIX<run_id>/parts: the same path's key in the artifacts bucket."""
    return RUNS_PREFIX + "/".join((run_id, *parts))
