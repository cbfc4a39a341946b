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

from pipeline_contract.layout import (  # noqa: F401
    FSX_MOUNT_POINT, FSX_DATA, FSX_RUNS, FSX_CANARY, RUNS_PREFIX, INCOMING_PREFIX, FSX_INCOMING, MODELS_PREFIX,
    SUCCESS_MARKER, TeamPaths, PREPARED_DIR, PREPARE_REPORT, COMPILE_DIR, COMPILE_REPORT, COMPILE_CACHE_DIR,
    CHECKPOINTS_DIR, TRAIN_DIR, TRAIN_METRICS, TRAIN_SUMMARY, VALIDATION_DIR, VALIDATION_METRICS, GATE_REPORT,
    EMBEDDINGS_DIR, EMBEDDINGS_MANIFEST, EXPORT_DIR, run_path, run_key,
)
from pipeline_contract.exit_codes import (  # noqa: F401
    ExitCode,
)
from pipeline_contract.environment import (  # noqa: F401
    RUN_ID_PARAMETER, INSTANCE_TYPE_ENV, NPROC_PER_NODE_ENV, RDZV_TIMEOUT_ENV, STAGE_ENV, RUN_ID_ENV,
    EXIT_CODE_FILE_ENV, TEAM_ENV, COMPILE_CACHE_BASE_ENV, HEARTBEAT_NAMESPACE, HEARTBEAT_STEP_METRIC,
    HEARTBEAT_LOSS_METRIC, HEARTBEAT_THROUGHPUT_METRIC, HEARTBEAT_STAGE_DIMENSION, HEARTBEAT_RUN_DIMENSION,
    SUCCESS_MARKER_ENV, MLFLOW_TRACKING_URI_ENV, MLFLOW_EXPERIMENT_ENV, DEFAULT_MLFLOW_EXPERIMENT,
    TRAINING_IMAGE_URI_ENV, TRAINING_IMAGE_DIGEST_ENV, GIT_COMMIT_ENV,
)
from pipeline_contract.instances import (  # noqa: F401
    InstanceSpec, INSTANCE_TYPES, DEFAULT_TRAINING_INSTANCE_TYPE, DEFAULT_SINGLE_NODE_INSTANCE_TYPE, instance_spec,
    NeuronSdk, NEURON_SDK, ami_build_date, ami_driver_problem, SHARE_IDENTIFIER_RE, LOG_RETENTION_DAYS,
)
from pipeline_contract.stack_outputs import (  # noqa: F401
    DEFAULT_PROJECT, stack_name, DATA_BUCKET_OUTPUT, ARTIFACTS_BUCKET_OUTPUT, STATE_MACHINE_OUTPUT,
    TRAINING_INSTANCE_TYPE_OUTPUT, SINGLE_NODE_INSTANCE_TYPE_OUTPUT, MLFLOW_TRACKING_SERVER_OUTPUT,
)
from pipeline_contract.steps import (  # noqa: F401
    Launcher, AttemptTimeout, TRAINING_QUEUE, SINGLE_NODE_QUEUE, TrainingSettings, RUN_DIR,
    PREPARE_UPLOAD_TIMEOUT_S, PipelineStep, training_arguments, PIPELINE_STEPS, CANARY, BATCH_JOBS, batch_job,
)
