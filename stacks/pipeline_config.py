"""Typed configuration of the orchestration layer (state machine, triggers, canary, alarms).

One `PipelineConfig` lives in every stage config (`StageConfig.pipeline`, stacks/config.py).
It is default-constructible: the defaults are what a production stage should run with; a stage
overrides only what differs, e.g. `PipelineConfig(canary_interval_minutes=None)` for a dev stage
that should not pay for an hourly trn1.2xlarge.

Every check raises `ValueError` with a fix-it message, at synth time, before anything reaches AWS.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from pipeline_steps import contract

# Batch SubmitJob: schedulingPriorityOverride must be 0..9999 (higher = scheduled first).
# https://docs.aws.amazon.com/batch/latest/APIReference/API_SubmitJob.html
_MAX_PRIORITY = 9999
# Step Functions retriers: MaxDelaySeconds must be < 31622400 (one year); keep it sane instead.
_MAX_RETRY_DELAY_SECONDS = 3600
_EMAIL_RE = re.compile(r"^[^@\s]+@[^@\s]+\.[^@\s]+$")
# A tracking URI has a scheme ("https://...", "arn:aws:sagemaker:...", "databricks", "file:///...").
_URI_RE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:\S+$")
MLFLOW_MANAGED = "managed"
# SageMaker managed MLflow tracking server sizes (AWS::SageMaker::MlflowTrackingServer TrackingServerSize).
MLFLOW_SERVER_SIZES: tuple[str, ...] = ("Small", "Medium", "Large")


@dataclass(frozen=True, kw_only=True)
class PipelineConfig:
    """Orchestration settings for one stage."""

    # -- Batch submissions ---------------------------------------------------------------
    default_num_nodes: int = 2
    """Nodes for the multi-node steps (Sanity, Compile, Train) when the execution input has no
    `num_nodes`. Sanity and Compile always use the same count as Train: the compile cache is keyed
    by world size, and a sanity check of a different topology proves nothing. Must not exceed the
    training compute environment's max nodes (checked by StageConfig, which knows both)."""

    production_share: str = "production"
    """Fair-share identifier for scheduled/triggered runs. Must be one of the compute stack's
    `share_identifiers`; every submission carries one because the queues have a fair-share policy."""

    experiments_share: str = "experiments"
    """Fair-share identifier for manual experiment runs (input `"share": "experiments"`)."""

    default_priority: int = 50
    """SchedulingPriorityOverride (0..9999, higher first) when the input has no `priority`."""

    embed_array_size: int = 4
    """Default number of embed shards (Batch array size, 2..10000) when the input has no
    `embed_shards`. Each child embeds catalog shard AWS_BATCH_JOB_ARRAY_INDEX of the size."""

    prepare_array_size: int = 4
    """Default number of prepare shards (Batch array size, 2..10000) when the input has no
    `prepare_shards`. Each child validates and tokenises its share of the pair input's units
    (about 32 MB of JSON Lines or one Parquet row group each); the count never changes the
    prepared data, only how many instances share the work."""

    # -- Startup bound (minutes): one value for every "the job has not started stepping yet" clock --
    startup_minutes: int = 30
    """Bound on a multi-node job's start, counted from the Batch RUNNING event of the job (the
    main node's container is up): the child nodes boot, pull the training image, join torchrun's
    rendezvous, and the first graphs load from the compile cache. One value drives three settings:
    the torchrun rendezvous timeout of the multi-node job definitions (env
    TORCHRUN_RDZV_TIMEOUT_SECONDS), part of the stall watchdog's `first_heartbeat_minutes`, and the
    startup share of every Batch state's timeout (`state_timeout`)."""

    # -- Retries of Batch API errors only    # -- Retries of Batch API errors only (host/exit-code retries are the job definitions') ---
    retry_interval_seconds: int = 5
    retry_max_attempts: int = 6
    retry_backoff_rate: float = 2.0
    retry_max_delay_seconds: int = 300
    """Exponential backoff with full jitter for Batch.AWSBatchException / ServerException /
    TooManyRequestsException: 5 s, 10 s, 20 s, ... capped at 5 minutes, randomised."""

    # -- Canary --------------------------------------------------------------------------
    canary_interval_minutes: int | None = 60
    """Run the single-node sanity canary every N minutes; None disables it (and its alarm).
    M5 ran hourly canaries to find bad hosts before a training run does."""

    canary_num_nodes: int = 1

    # -- Stuck jobs ----------------------------------------------------------------------
    stall_timeout_minutes: int = 30
    """Minutes without a training-progress heartbeat (metric TrainStep) before the stall alarm
    fires and the running Train job is terminated. 30 as in M5; must exceed the longest honest
    gap between heartbeats (first-step graph compilation when the cache is cold). The alarm is put
    on the job's first heartbeat, so no job is terminated for a slow start (`first_heartbeat_minutes`)."""

    first_heartbeat_minutes: int = 120
    """Bound from the train job's RUNNING to its first heartbeat. A job that reaches it without one is
    terminated by the stall watchdog (its process is too frozen to exit). Must cover startup_minutes
    (rendezvous), the data and model load, and the in-process watchdog's first-step allowance (2 x
    train --stall-timeout-s, default 1800 s), which exits 75 first, so that Batch retries the job:
    at least startup_minutes + 2 x stall_timeout_minutes."""

    # -- Triggers ------------------------------------------------------------------------
    trigger_enabled: bool = True
    """Start a run when `incoming/<dataset>/<version>/_SUCCESS` is created in the data bucket."""

    incoming_prefix: str = contract.INCOMING_PREFIX
    success_marker: str = "_SUCCESS"

    # -- Notifications and logs ----------------------------------------------------------
    notification_email: str | None = None
    """Optional e-mail subscribed to the alarm/notification topic (confirm the subscription)."""

    log_retention_days: int = 365
    """Retention of the state machine's execution log group (a valid CloudWatch value)."""

    # -- Experiment tracking (MLflow; pipeline_steps/tracking.py) ------------------
    mlflow_tracking: str | None = None
    """Where every step logs its MLflow child run (job env MLFLOW_TRACKING_URI):
    "managed" = the compute stack creates a SageMaker managed MLflow tracking server
    (stacks/constructs/mlflow_tracking.py) and the jobs log to its ARN; any other string is used
    as the tracking URI as is (e.g. an existing server's ARN or https URL); None = no server: each
    run logs to its own file store DIR/mlruns on FSx, exported to S3 with the run. Default None
    (unlike the other defaults here, not the production value): a managed server is billed every
    hour it exists, so a stage opts in (prod does, see stacks/config.py STAGES)."""

    mlflow_server_size: str = "Small"
    """Managed server size (Small, Medium, Large). Small serves up to ~25 users / light
    load, plenty for one pipeline's step-level logging."""

    def __post_init__(self) -> None:
        self._check_batch_settings()
        self._check_time_bounds()
        self._check_trigger_and_tracking()

    def _check_batch_settings(self) -> None:
        """Node counts, share identifiers, priority, array size."""
        if self.default_num_nodes < 1:
            raise ValueError(
                f"PipelineConfig.default_num_nodes={self.default_num_nodes}: must be >= 1 "
                "(use 1 for single-node training, 2+ for multi-node)."
            )
        if self.canary_num_nodes < 1:
            raise ValueError(f"PipelineConfig.canary_num_nodes={self.canary_num_nodes}: must be >= 1.")
        for name in ("production_share", "experiments_share"):
            value = getattr(self, name)
            if not contract.SHARE_IDENTIFIER_RE.match(value):
                raise ValueError(
                    f"PipelineConfig.{name}={value!r}: a Batch share identifier is 1-255 letters, "
                    "digits or underscores; use one of the compute stack's share_identifiers."
                )
        if not 0 <= self.default_priority <= _MAX_PRIORITY:
            raise ValueError(
                f"PipelineConfig.default_priority={self.default_priority}: Batch accepts 0..{_MAX_PRIORITY}."
            )
        if not 2 <= self.embed_array_size <= 10_000:
            raise ValueError(
                f"PipelineConfig.embed_array_size={self.embed_array_size}: a Batch array job has 2..10000 "
                "children; for a single shard raise it to 2 or embed in the validate step."
            )
        if not 2 <= self.prepare_array_size <= 10_000:
            raise ValueError(
                f"PipelineConfig.prepare_array_size={self.prepare_array_size}: a Batch array job has 2..10000 "
                "children (https://docs.aws.amazon.com/batch/latest/userguide/array_jobs.html)."
            )

    def _check_time_bounds(self) -> None:
        """Startup, retries, canary interval and stall timeout."""
        if not 5 <= self.startup_minutes <= 6 * 60:
            raise ValueError(
                f"PipelineConfig.startup_minutes={self.startup_minutes}: use 5..360; it must cover child-node "
                "boot, image pull, rendezvous and the first (cached) graph load."
            )
        if self.retry_interval_seconds < 1 or self.retry_max_attempts < 1:
            raise ValueError(
                "PipelineConfig.retry_interval_seconds and retry_max_attempts must be >= 1 "
                f"(got {self.retry_interval_seconds}, {self.retry_max_attempts})."
            )
        if self.retry_backoff_rate < 1.0:
            raise ValueError(
                f"PipelineConfig.retry_backoff_rate={self.retry_backoff_rate}: must be >= 1.0 (exponential backoff)."
            )
        if not self.retry_interval_seconds <= self.retry_max_delay_seconds <= _MAX_RETRY_DELAY_SECONDS:
            raise ValueError(
                f"PipelineConfig.retry_max_delay_seconds={self.retry_max_delay_seconds}: must be between "
                f"retry_interval_seconds ({self.retry_interval_seconds}) and {_MAX_RETRY_DELAY_SECONDS}."
            )
        if self.canary_interval_minutes is not None and not 5 <= self.canary_interval_minutes <= 24 * 60:
            raise ValueError(
                f"PipelineConfig.canary_interval_minutes={self.canary_interval_minutes}: use 5..1440, "
                "or None to disable the canary."
            )
        if not 5 <= self.stall_timeout_minutes <= 24 * 60:
            raise ValueError(
                f"PipelineConfig.stall_timeout_minutes={self.stall_timeout_minutes}: use 5..1440; the heartbeat "
                "is per step, so anything below the slowest step's duration kills healthy jobs."
            )
        least = self.startup_minutes + 2 * self.stall_timeout_minutes
        if not least <= self.first_heartbeat_minutes <= 24 * 60:
            raise ValueError(
                f"PipelineConfig.first_heartbeat_minutes={self.first_heartbeat_minutes}: use {least}..1440 "
                f"(startup_minutes + 2 x stall_timeout_minutes: a healthy job may take the startup bound to start "
                "stepping, and the in-process watchdog allows its first step twice the stall timeout)."
            )

    def _check_trigger_and_tracking(self) -> None:
        """The trigger's upload layout, notifications, log retention and MLflow."""
        if not self.incoming_prefix or not self.incoming_prefix.endswith("/") or self.incoming_prefix.startswith("/"):
            raise ValueError(
                f"PipelineConfig.incoming_prefix={self.incoming_prefix!r}: use a key prefix like 'incoming/' "
                "(no leading slash, trailing slash)."
            )
        if not self.success_marker or "/" in self.success_marker:
            raise ValueError(
                f"PipelineConfig.success_marker={self.success_marker!r}: a plain object name like '_SUCCESS'."
            )
        if self.notification_email is not None and not _EMAIL_RE.match(self.notification_email):
            raise ValueError(
                f"PipelineConfig.notification_email={self.notification_email!r}: not an e-mail address; "
                "use None for no subscription."
            )
        if self.log_retention_days not in contract.LOG_RETENTION_DAYS:
            raise ValueError(
                f"PipelineConfig.log_retention_days={self.log_retention_days}: use a CloudWatch Logs value "
                f"{contract.LOG_RETENTION_DAYS}."
            )
        tracking = self.mlflow_tracking
        if tracking is not None and tracking != MLFLOW_MANAGED and (
                tracking.strip().lower() == MLFLOW_MANAGED or not _URI_RE.match(tracking)):
            raise ValueError(
                f"PipelineConfig.mlflow_tracking={tracking!r}: use {MLFLOW_MANAGED!r} (a SageMaker managed "
                "MLflow server created by the stack), a tracking URI with a scheme (e.g. "
                "'arn:aws:sagemaker:us-east-1:123456789012:mlflow-tracking-server/NAME' or 'https://...'), "
                "or None (each run's file store DIR/mlruns)."
            )
        if self.mlflow_server_size not in MLFLOW_SERVER_SIZES:
            raise ValueError(
                f"PipelineConfig.mlflow_server_size={self.mlflow_server_size!r}: use one of {MLFLOW_SERVER_SIZES}."
            )

    @property
    def mlflow_managed(self) -> bool:
        """True when the stage runs its own SageMaker managed MLflow tracking server."""
        return self.mlflow_tracking == MLFLOW_MANAGED

    def state_timeout_minutes(self, *, attempt_minutes: int, attempts: int, queue_wait_minutes: int) -> int:
        """TimeoutSeconds (in minutes) of a Batch state that waits for every attempt of its job.

        Batch retries a job inside the same SubmitJob (the .sync task sees only the final state),
        and each attempt may wait RUNNABLE up to the queue's time limit, start (image pull,
        `startup_minutes`) and then run up to its attempt timeout. So the state's budget is
        attempts x (queue wait + startup + attempt timeout): a retry can always finish."""
        if attempt_minutes < 1 or attempts < 1 or queue_wait_minutes < 0:
            raise ValueError(
                f"state_timeout_minutes: attempt_minutes={attempt_minutes}, attempts={attempts} must be >= 1 and "
                f"queue_wait_minutes={queue_wait_minutes} >= 0; set the job definition's timeout and retry attempts."
            )
        return attempts * (queue_wait_minutes + self.startup_minutes + attempt_minutes)
