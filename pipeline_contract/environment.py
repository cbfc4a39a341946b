"""The names the job definitions, the image entrypoint and the steps agree on: Batch parameters,
container environment variables and the heartbeat's CloudWatch metric names."""

from __future__ import annotations

RUN_ID_PARAMETER = "run_id"
"""Batch parameter with the run id (= execution name): `--run-dir FSX_RUNS/Ref::run_id` in the job
definitions, set by the state machine, read from job events by the stall watchdog."""
INSTANCE_TYPE_ENV = "INSTANCE_TYPE"
"""Set by every job definition to its instance type (a key of INSTANCE_TYPES); sanity and MLflow read it."""
NPROC_PER_NODE_ENV = "NPROC_PER_NODE"
"""Set by every job definition to the NeuronCores per node; the entrypoint's torchrun --nproc_per_node."""
RDZV_TIMEOUT_ENV = "TORCHRUN_RDZV_TIMEOUT_SECONDS"
"""Set by the compute stack (PipelineConfig.startup_minutes); the entrypoint's torchrun rendezvous bound."""
STAGE_ENV = "PIPELINE_STAGE"
"""Set by the compute stack to the stage name; the heartbeat's Stage dimension."""
RUN_ID_ENV = "PIPELINE_RUN_ID"
"""Exported by the entrypoint: --run-dir below FSX_RUNS (`<team>/<name>` for a team's run), else its
basename; the heartbeat's RunId and MLflow's run tag."""
EXIT_CODE_FILE_ENV = "PIPELINE_EXIT_CODE_FILE"
"""Exported by the entrypoint for torchrun steps: where the first failing rank records its ExitCode."""
TEAM_ENV = "PIPELINE_TEAM"
"""Set by a team's job definitions to the team's name; MLflow tags the pipeline's runs with it."""
COMPILE_CACHE_BASE_ENV = "NEURON_COMPILE_CACHE_URL_BASE"
"""Set by the compute stack to the S3 compile cache; pipeline_steps.distributed derives the cache URL."""

# ---- Heartbeat metrics (CloudWatch EMF) ----------------------------------------------------------

HEARTBEAT_NAMESPACE = "TrainiumEmbeddings"
"""Namespace pipeline_steps.heartbeat publishes in; the stall alarm and the dashboard read it."""
HEARTBEAT_STEP_METRIC = "TrainStep"
"""The optimizer step just completed: the progress the stall alarm watches."""
HEARTBEAT_LOSS_METRIC = "TrainLoss"
"""Training loss of that step (dashboard, `trainium-runs status`)."""
HEARTBEAT_THROUGHPUT_METRIC = "TokensPerSecond"
"""Training throughput of all ranks (dashboard, `trainium-runs status`)."""
HEARTBEAT_STAGE_DIMENSION = "Stage"
"""Dimension with the stage name (STAGE_ENV)."""
HEARTBEAT_RUN_DIMENSION = "RunId"
"""Dimension with the run id (RUN_ID_ENV); the per-job stall alarm filters on it."""

SUCCESS_MARKER_ENV = "PIPELINE_SUCCESS_MARKER"
"""Set by the compute stack only when the stage's PipelineConfig.success_marker is not the default
SUCCESS_MARKER: the marker prepare waits for (and checks the manifest of) in the upload."""

# ---- MLflow and the image (pipeline_steps.tracking reads them) -------------------------------------

MLFLOW_TRACKING_URI_ENV = "MLFLOW_TRACKING_URI"
"""Set by the compute stack to the SageMaker managed MLflow server's ARN; unset: a file store in the run dir."""
MLFLOW_EXPERIMENT_ENV = "MLFLOW_EXPERIMENT_NAME"
"""Set by the compute stack to `<project>-<stage>` (a team's: with the team's name)."""
DEFAULT_MLFLOW_EXPERIMENT = "trainium-embeddings"
"""The experiment when MLFLOW_EXPERIMENT_ENV is unset (local runs)."""
TRAINING_IMAGE_URI_ENV = "TRAINING_IMAGE_URI"
"""Set by the compute stack to the image the jobs run; recorded with every MLflow run."""
TRAINING_IMAGE_DIGEST_ENV = "TRAINING_IMAGE_DIGEST"
"""The image's digest, when the environment sets it; recorded with every MLflow run."""
GIT_COMMIT_ENV = "GIT_COMMIT"
"""Baked into the image at build time (training_image/Dockerfile ARG); else the checkout's commit."""
