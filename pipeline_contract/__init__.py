"""The contract between the layers: the infrastructure (stacks/), the image (training_image/), the
steps (pipeline_steps/) and the operator CLI (pipeline_ops/) all import it; it imports none of them,
and no torch (`cdk synth` and `trainium-runs` run on machines without it).

Every fact two layers must agree on is written here once: the step table (steps.py), the execution
input and its bounds (execution_input.py), the FSx paths, the upload marker and the run directory
(layout.py), the exit codes (exit_codes.py), the Batch parameters, environment variables and
heartbeat metric names (environment.py), the stack outputs (stack_outputs.py), the Trainium
instance table and the Neuron SDK release (instances.py). The copies that cannot import it are
pinned by tests: the entrypoint's (shell) by tests/infra/test_training_image.py, the README's
tables by tests/contract/.
"""

from __future__ import annotations

from pipeline_contract import execution_input  # noqa: F401 (the field names: execution_input.NUM_NODES, ...)
from pipeline_contract.environment import (  # noqa: F401
    COMPILE_CACHE_BASE_ENV,
    DEFAULT_MLFLOW_EXPERIMENT,
    EXIT_CODE_FILE_ENV,
    GIT_COMMIT_ENV,
    HEARTBEAT_LOSS_METRIC,
    HEARTBEAT_NAMESPACE,
    HEARTBEAT_RUN_DIMENSION,
    HEARTBEAT_STAGE_DIMENSION,
    HEARTBEAT_STEP_METRIC,
    HEARTBEAT_THROUGHPUT_METRIC,
    INSTANCE_TYPE_ENV,
    MLFLOW_EXPERIMENT_ENV,
    MLFLOW_TRACKING_URI_ENV,
    NPROC_PER_NODE_ENV,
    RDZV_TIMEOUT_ENV,
    RUN_ID_ENV,
    RUN_ID_PARAMETER,
    STAGE_ENV,
    SUCCESS_MARKER_ENV,
    TEAM_ENV,
    TRAINING_IMAGE_DIGEST_ENV,
    TRAINING_IMAGE_URI_ENV,
)
from pipeline_contract.exit_codes import ExitCode  # noqa: F401
from pipeline_contract.instances import (  # noqa: F401
    DEFAULT_SINGLE_NODE_INSTANCE_TYPE,
    DEFAULT_TRAINING_INSTANCE_TYPE,
    INSTANCE_TYPES,
    LOG_RETENTION_DAYS,
    NEURON_SDK,
    SHARE_IDENTIFIER_RE,
    SHARE_WEIGHT,
    InstanceSpec,
    NeuronSdk,
    ami_build_date,
    ami_driver_problem,
    instance_spec,
)
from pipeline_contract.layout import (  # noqa: F401
    CHECKPOINTS_DIR,
    COMPILE_CACHE_DIR,
    COMPILE_DIR,
    COMPILE_REPORT,
    EMBEDDINGS_DIR,
    EMBEDDINGS_MANIFEST,
    EXPORT_DIR,
    FSX_CANARY,
    FSX_DATA,
    FSX_INCOMING,
    FSX_MOUNT_POINT,
    FSX_RUNS,
    GATE_REPORT,
    INCOMING_PREFIX,
    MODELS_PREFIX,
    PREPARE_REPORT,
    PREPARED_DIR,
    RUNS_PREFIX,
    SUCCESS_MARKER,
    TRAIN_DIR,
    TRAIN_METRICS,
    TRAIN_SUMMARY,
    VALIDATION_DIR,
    VALIDATION_METRICS,
    TeamPaths,
    run_key,
    run_path,
)
from pipeline_contract.stack_outputs import (  # noqa: F401
    ARTIFACTS_BUCKET_OUTPUT,
    DATA_BUCKET_OUTPUT,
    DEFAULT_PROJECT,
    MLFLOW_TRACKING_SERVER_OUTPUT,
    SINGLE_NODE_INSTANCE_TYPE_OUTPUT,
    STATE_MACHINE_OUTPUT,
    TRAINING_INSTANCE_TYPE_OUTPUT,
    stack_name,
)
from pipeline_contract.steps import (  # noqa: F401
    BATCH_JOBS,
    CANARY,
    PIPELINE_STEPS,
    PREPARE_UPLOAD_TIMEOUT_S,
    RUN_DIR,
    SINGLE_NODE_QUEUE,
    TRAINING_QUEUE,
    AttemptTimeout,
    Launcher,
    PipelineStep,
    TrainingSettings,
    batch_job,
    training_arguments,
)
