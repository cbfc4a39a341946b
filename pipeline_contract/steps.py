"""The step table: every Batch job of the pipeline, in pipeline order, with what each layer needs of
it. The job definitions, the state machine (its Batch states, their SubmitJob fields and timeouts),
`trainium-runs` and the CLI registry are generated from it; adding a step is one entry here plus its
module in pipeline_steps/steps/ (docs/orchestration.md, "Adding a step").
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Protocol

from pipeline_contract import execution_input as run_input
from pipeline_contract.environment import RUN_ID_PARAMETER
from pipeline_contract.layout import EXPORT_DIR, FSX_CANARY, FSX_MOUNT_POINT, run_path


class Launcher(enum.Enum):
    """How Batch runs a step."""

    SINGLE_NODE = "single-node"
    """One container on the single-node instance type."""
    MULTI_NODE = "multi-node"
    """A multi-node parallel job on the training instance type; the entrypoint starts torchrun."""
    ARRAY = "array"
    """An array job on the single-node instance type: one child per shard, the size from the input."""


class AttemptTimeout(enum.Enum):
    """Which of the stage's timeouts bounds one attempt of the job (ComputeConfig)."""

    TRAIN = "train"
    COMPILE = "compile"
    SHORT = "short"


TRAINING_QUEUE = "training"
"""The fair-share queue of the training compute environment (multi-node steps)."""
SINGLE_NODE_QUEUE = "single-node"
"""The queue of the single-node compute environment (every other step and the canary)."""


class TrainingSettings(Protocol):
    """What the argument builders read of the stage's training settings (stacks.config.TrainingConfig)."""

    @property
    def preset(self) -> str: ...

    @property
    def bf16(self) -> bool: ...


RUN_DIR = run_path(f"Ref::{RUN_ID_PARAMETER}")
"""A job's --run-dir: the run id comes in as a Batch parameter."""
PREPARE_UPLOAD_TIMEOUT_S = 1800
"""How long prepare waits for FSx for Lustre to import every file of an upload before it exits 75
(retried by Batch): automatic import from S3 is asynchronous, so the upload marker's event can
arrive before the upload is visible on /fsx
(https://docs.aws.amazon.com/fsx/latest/LustreGuide/autoimport-data-repo-dra.html)."""


@dataclass(frozen=True, kw_only=True)
class PipelineStep:
    """One Batch job of the pipeline (or the canary). Batch parameters cannot be optional, so an
    optional flag's parameter defaults to "" and the entrypoint drops the flag."""

    name: str
    """The job definition key and Batch job name."""
    launcher: Launcher
    arguments: Callable[[TrainingSettings], list[str]]
    """The arguments after `python -m pipeline_steps <command>` in the job definition."""
    parameters: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    """The job definition's parameter defaults ("Ref::<name>" in the arguments)."""
    command: str = ""
    """The CLI step it runs; default: the name."""
    array_size_field: str | None = None
    """The execution input field with the shard count: the array's size, passed as `shard_count`."""
    run_parameters: tuple[str, ...] = ()
    """Parameters the state machine fills per run besides run_id, data_uri and init_from."""
    attempt_timeout: AttemptTimeout = AttemptTimeout.SHORT
    after_gate: bool = False
    """Runs only when the model passed the quality gate (which follows the step before it)."""

    def __post_init__(self) -> None:
        if not self.command:
            object.__setattr__(self, "command", self.name)

    @property
    def state(self) -> str:
        """Its Step Functions state name and construct id ("PrepareShards" for "prepare-shards")."""
        return "".join(part.capitalize() for part in self.name.split("-"))

    @property
    def multi_node(self) -> bool:
        return self.launcher is Launcher.MULTI_NODE

    @property
    def queue(self) -> str:
        return TRAINING_QUEUE if self.multi_node else SINGLE_NODE_QUEUE

    def job_command(self, training: TrainingSettings) -> list[str]:
        """The job definition's command (the image entrypoint's arguments)."""
        return [self.command, *self.arguments(training)]


def training_arguments(training: TrainingSettings) -> list[str]:
    """The `train` step's arguments: the one definition both the Compile and the Train job run.
    Compile passes them through unchanged to `neuron_parallel_compile torchrun ... train` (only the
    trial's run dir and step count are appended), so every flag that shapes a graph -- preset
    (model and batch shape), precision, backend -- is the same in both by construction."""
    arguments = ["--run-dir", RUN_DIR, "--preset", training.preset, "--backend", "xla", "--init-from", "Ref::init_from"]
    return arguments + (["--bf16"] if training.bf16 else [])


def _prepare_plan(training: TrainingSettings) -> list[str]:
    # Tokenizes for the stage's training preset (vocabulary, length buckets): the preset Compile and Train run.
    return [
        "--phase",
        "plan",
        "--run-dir",
        RUN_DIR,
        "--data",
        "Ref::data_uri",
        "--preset",
        training.preset,
        "--init-from",
        "Ref::init_from",
        "--upload-timeout",
        str(PREPARE_UPLOAD_TIMEOUT_S),
    ]


def _fixed(*arguments: str) -> Callable[[TrainingSettings], list[str]]:
    """The builder of arguments that do not depend on the training settings."""
    return lambda _training: list(arguments)


_SHARDS = ("--run-dir", RUN_DIR, "--shard-count", "Ref::shard_count")
_NODE_CHECKS = ("--fsx-path", FSX_MOUNT_POINT)

PIPELINE_STEPS: tuple[PipelineStep, ...] = (
    # Prepare runs as three jobs: the plan reads the flags (catalog, tokenizer, units of the pairs),
    # the array children tokenise one shard each, the finish counts and writes the outputs.
    PipelineStep(name="prepare", launcher=Launcher.SINGLE_NODE, arguments=_prepare_plan, parameters={"init_from": ""}),
    PipelineStep(
        name="prepare-shards",
        launcher=Launcher.ARRAY,
        command="prepare",
        arguments=_fixed("--phase", "shard", *_SHARDS),
        parameters={"shard_count": ""},
        array_size_field=run_input.PREPARE_SHARDS,
    ),
    # Not an array, but its error names the shards to rerun, so it gets the count too.
    PipelineStep(
        name="prepare-finish",
        launcher=Launcher.SINGLE_NODE,
        command="prepare",
        arguments=_fixed("--phase", "finish", *_SHARDS),
        parameters={"shard_count": ""},
        array_size_field=run_input.PREPARE_SHARDS,
    ),
    PipelineStep(name="sanity", launcher=Launcher.MULTI_NODE, arguments=_fixed("--run-dir", RUN_DIR, *_NODE_CHECKS)),
    PipelineStep(
        name="compile",
        launcher=Launcher.MULTI_NODE,
        arguments=training_arguments,
        parameters={"init_from": ""},
        attempt_timeout=AttemptTimeout.COMPILE,
    ),
    PipelineStep(
        name="train",
        launcher=Launcher.MULTI_NODE,
        arguments=lambda training: [*training_arguments(training), "--max-steps", "Ref::max_steps"],
        parameters={"init_from": "", "max_steps": ""},
        attempt_timeout=AttemptTimeout.TRAIN,
    ),
    # --gate-report-only: exit 0 on a failed gate (the decision is data for the state machine's
    # Choice); the step uploads gate.json to gate_s3_uri itself, as the FSx auto-export to S3 is asynchronous.
    PipelineStep(
        name="validate",
        launcher=Launcher.SINGLE_NODE,
        arguments=_fixed(
            "--run-dir",
            RUN_DIR,
            "--previous-metrics",
            "Ref::previous_metrics",
            "--gate-report-only",
            "--gate-s3-uri",
            "Ref::gate_s3_uri",
        ),
        parameters={"previous_metrics": "", "gate_s3_uri": ""},
        run_parameters=("gate_s3_uri", run_input.PREVIOUS_METRICS),
    ),
    # The shard index comes from AWS_BATCH_JOB_ARRAY_INDEX (Batch sets it on every child), the count
    # from the `shard_count` parameter: Batch sets no AWS_BATCH_JOB_ARRAY_SIZE and rejects AWS_BATCH*
    # environment overrides. Default "": the flag is dropped, and an array child without a count
    # fails with exit 78 instead of embedding the wrong slice.
    PipelineStep(
        name="embed",
        launcher=Launcher.ARRAY,
        arguments=_fixed("--run-dir", RUN_DIR, "--checkpoint", "Ref::checkpoint", "--shard-count", "Ref::shard_count"),
        parameters={"checkpoint": "", "shard_count": ""},
        array_size_field=run_input.EMBED_SHARDS,
        after_gate=True,
    ),
    # The published model in the sentence-transformers format, uploaded by the step itself to
    # export_s3_uri (files first, the upload marker last) because the FSx auto-export to S3 is
    # asynchronous: the pointer written after this job names an export that is complete in S3.
    # --run-dir: the last Batch job of a run that passed the gate closes the run's MLflow run.
    PipelineStep(
        name="export",
        launcher=Launcher.SINGLE_NODE,
        arguments=_fixed(
            "--run-dir",
            RUN_DIR,
            "--checkpoint",
            RUN_DIR,
            "--out",
            f"{RUN_DIR}/{EXPORT_DIR}",
            "--s3-uri",
            "Ref::export_s3_uri",
        ),
        parameters={"export_s3_uri": ""},
        run_parameters=("export_s3_uri",),
    ),
)
"""In pipeline order: each state leads to the next one (through the quality gate to an `after_gate`
one); the last leads to publishing the model."""

CANARY = PipelineStep(
    name="canary",
    launcher=Launcher.SINGLE_NODE,
    command="sanity",
    arguments=_fixed("--run-dir", f"{FSX_CANARY}/Ref::{RUN_ID_PARAMETER}", *_NODE_CHECKS),
    parameters={RUN_ID_PARAMETER: "latest"},
)
"""The scheduled sanity canary: node-local checks on the single-node instance type, outside the
exported runs directory; a job definition, not a pipeline state."""

BATCH_JOBS: tuple[PipelineStep, ...] = (*PIPELINE_STEPS, CANARY)
"""Every job definition of a stage."""


def batch_job(name: str) -> PipelineStep:
    """The entry of BATCH_JOBS named `name`."""
    for step in BATCH_JOBS:
        if step.name == name:
            return step
    raise KeyError(f"no Batch job {name!r} in the step table; known: {[step.name for step in BATCH_JOBS]}")
