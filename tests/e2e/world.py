"""The deployed shape, locally: the synthesized dev stage's state machines, rule and job definitions
in moto, with every Batch job run for real by the local Batch (local_batch.py).

    with E2EWorld(work_dir) as world:
        world.upload_dataset("catalog", "v1", demo_dir)      # incoming/catalog/v1/... then _SUCCESS
        result = world.wait_for_run("catalog-v1")            # the EventBridge rule's starter named it
        print(world.format_path(result))

Moto serves the same in-memory AWS to this process (mock_aws) and, over HTTP, to the job
processes (a ThreadedMotoServer on a free port: AWS_ENDPOINT_URL in every job's environment).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
from moto import mock_aws
from moto.server import ThreadedMotoServer

from pipeline_contract import CANARY, FSX_INCOMING, FSX_MOUNT_POINT, TeamPaths, run_path
from tests.e2e.local_batch import JobDefinitionSpec, JobRun, LocalBatch, LocalSetup
from tests.e2e.stage import Stage, synthesize
from tests.infra.moto_batch import eventbridge_starts_executions, patched_moto_batch

MOTO_CONFIG = {"stepfunctions": {"execute_state_machine": True}, "batch": {"use_docker": False}}
BUCKETS = {"data_bucket": "trnembed-dev-data", "artifacts_bucket": "trnembed-dev-artifacts",
           "cache_bucket": "trnembed-dev-cache"}
SINGLE_NODE_QUEUE = "single-node"  # the canary's queue (stacks/constructs/trainium_compute.py)
DATA_REPOSITORY_PREFIX = "incoming/"  # what the FSx data repository association imports to /fsx/data/


def one_node_run_input(dataset: str, version: str, *, init_from: str) -> dict[str, Any]:
    """The input of a run started by hand on one node: every job is one process, so the Compile and
    Train jobs run their production commands unsubstituted (substitutions.py)."""
    return {"dataset": dataset, "version": version, "data_uri": f"{FSX_INCOMING}/{dataset}/{version}",
            "init_from": init_from, "num_nodes": 1, "embed_shards": 2}


def local_run_dir(fsx_root: Path, run_id: str) -> Path:
    """A run's directory as the local Batch maps it: the jobs' run_path(run_id) under fsx_root."""
    return fsx_root / Path(run_path(run_id)).relative_to(FSX_MOUNT_POINT)


@dataclass
class RunResult:
    name: str
    arn: str
    status: str
    states: list[dict[str, Any]]  # {name, seconds} in the order entered
    jobs: list[JobRun]

    @property
    def visited(self) -> list[str]:
        return [s["name"] for s in self.states]


class E2EWorld:
    """Context manager; attributes after __enter__: stage, batch (LocalBatch), s3, sfn, buckets,
    pipeline_arn (the first team's pipeline), pipeline_arns (team, None for the default team -> its
    pipeline), topic_arn."""

    def __init__(self, work_dir: Path, *, nproc_per_node: int = 1, preset: str = "tiny",
                 stage: Stage | None = None) -> None:
        self.work_dir = Path(work_dir)
        self.nproc_per_node = nproc_per_node
        self.preset = preset
        self.stage = stage
        self._stack = ExitStack()
        self._queue_arns: dict[str, str] = {}
        self._definition_arns: dict[str, str] = {}

    # ---- set-up ----------------------------------------------------------------------------
    def __enter__(self) -> E2EWorld:
        stack = self._stack
        self.stage = self.stage or synthesize(self.preset)
        stack.enter_context(mock_aws(config=MOTO_CONFIG))
        self.hooks = stack.enter_context(patched_moto_batch())
        self.delivery_errors = stack.enter_context(eventbridge_starts_executions())
        logging.getLogger("werkzeug").setLevel(logging.WARNING)  # no line per request from the jobs
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        stack.callback(server.stop)
        host, port = server.get_host_and_port()
        region = self.stage.region
        self.s3 = boto3.client("s3", region_name=region)
        self.sfn = boto3.client("stepfunctions", region_name=region)
        self._batch_api = boto3.client("batch", region_name=region)
        setup = LocalSetup(work_dir=self.work_dir, endpoint_url=f"http://{host}:{port}", region=region,
                           nproc_per_node=self.nproc_per_node)
        self._create_buckets()
        definitions = self._create_batch()
        self._create_topic()
        self._create_state_machines()
        self._create_rule()
        self.batch = LocalBatch(setup, definitions, before_job=self.import_data_repository)
        self.hooks.run_job = self._run_job
        self._logs = boto3.client("logs", region_name=region)
        return self

    def __exit__(self, *exc_info) -> None:
        self._stack.close()

    def _create_buckets(self) -> None:
        storage = self.stage.stacks["storage"]
        self.buckets = {}
        for attribute, name in BUCKETS.items():
            self.s3.create_bucket(Bucket=name)
            self.stage.bind("storage", getattr(storage, attribute), name, Arn=f"arn:aws:s3:::{name}")
            self.buckets[attribute] = name
        # The data bucket sends its events to EventBridge (the stack's event_bridge_enabled=True).
        self.s3.put_bucket_notification_configuration(
            Bucket=self.buckets["data_bucket"], NotificationConfiguration={"EventBridgeConfiguration": {}})

    def _create_batch(self) -> dict[str, JobDefinitionSpec]:
        compute = self.stage.stacks["compute"]
        account = self.stage.account
        boto3.client("iam", region_name=self.stage.region).create_role(
            RoleName="batch-service", AssumeRolePolicyDocument="{}")
        ce = self._batch_api.create_compute_environment(
            computeEnvironmentName="local-ce", type="UNMANAGED",
            serviceRole=f"arn:aws:iam::{account}:role/batch-service")["computeEnvironmentArn"]
        for name, queue in compute.queues.items():
            arn = self._batch_api.create_job_queue(
                jobQueueName=name, state="ENABLED", priority=1,
                computeEnvironmentOrder=[{"order": 1, "computeEnvironment": ce}])["jobQueueArn"]
            self.stage.bind("compute", queue, arn, JobQueueArn=arn)
            self._queue_arns[name] = arn
        templates = self.stage.templates["compute"]["Resources"]
        definitions: dict[str, JobDefinitionSpec] = {}
        every = [(name, jd) for jobs in (compute.jobs, *compute.team_jobs.values())
                 for name, jd in jobs.job_definitions.items()]  # the canary's and every team's
        for name, job_definition in every:
            props = templates[self.stage.logical_id(job_definition)]["Properties"]
            spec = JobDefinitionSpec.from_properties(name, self.stage.resolve("compute", _runtime_fields(props)))
            arn = self._batch_api.register_job_definition(
                jobDefinitionName=props["JobDefinitionName"], type="container", parameters=spec.parameters,
                retryStrategy={"attempts": spec.attempts},
                containerProperties={"image": props.get("ContainerProperties", {}).get("Image", "training-image"),
                                     "vcpus": 1, "memory": 128, "command": spec.command})["jobDefinitionArn"]
            self.stage.bind("compute", job_definition, arn)
            definitions[arn] = spec
            self._definition_arns[name] = arn
        return definitions

    def _create_topic(self) -> None:
        pipeline = self.stage.stacks["pipeline"]
        sns = boto3.client("sns", region_name=self.stage.region)
        sqs = boto3.client("sqs", region_name=self.stage.region)
        self.topic_arn = sns.create_topic(Name="alerts")["TopicArn"]
        self.stage.bind("pipeline", pipeline.topic, self.topic_arn)
        self._sqs = sqs
        self._inbox = sqs.create_queue(QueueName="inbox")["QueueUrl"]
        inbox_arn = sqs.get_queue_attributes(QueueUrl=self._inbox, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
        sns.subscribe(TopicArn=self.topic_arn, Protocol="sqs", Endpoint=inbox_arn,
                      Attributes={"RawMessageDelivery": "true"})

    def _create_state_machines(self) -> None:
        pipeline = self.stage.stacks["pipeline"]
        role = f"arn:aws:iam::{self.stage.account}:role/states"
        # The failure classifier runs in this process (moto_batch.py's Lambda hook).
        classifier = f"arn:aws:lambda:{self.stage.region}:{self.stage.account}:function:FailureClassifier"
        self.stage.bind("pipeline", pipeline.diagnosis.function, "FailureClassifier", Arn=classifier)
        # One pipeline and starter per team (the default team's alone in a stage without teams).
        self.pipeline_arns: dict[str | None, str] = {}
        for team, team_pipeline in pipeline.pipelines.items():
            machine, starter, prefix = team_pipeline.pipeline.state_machine, team_pipeline.trigger.starter, \
                team_pipeline.prefix
            arn = self.sfn.create_state_machine(
                name=f"{prefix}TrainingPipeline", roleArn=role,
                definition=json.dumps(self.stage.state_machine_definition(machine)))["stateMachineArn"]
            self.stage.bind("pipeline", machine, arn, Name=f"{prefix}TrainingPipeline")
            self.pipeline_arns[team] = arn
            self.stage.bind("pipeline", starter, self.sfn.create_state_machine(
                name=f"{prefix}Starter", roleArn=role,
                definition=json.dumps(self.stage.state_machine_definition(starter)))["stateMachineArn"])
        self.pipeline_arn = next(iter(self.pipeline_arns.values()))

    def _create_rule(self) -> None:
        events = boto3.client("events", region_name=self.stage.region)
        for team_pipeline in self.stage.stacks["pipeline"].pipelines.values():
            rule, name = team_pipeline.trigger.rule, f"{team_pipeline.prefix}NewDataRule"
            props = self.stage.templates["pipeline"]["Resources"][self.stage.logical_id(rule)]["Properties"]
            events.put_rule(Name=name, EventPattern=json.dumps(self.stage.resolve("pipeline", props["EventPattern"])),
                            State=props.get("State", "ENABLED"))
            events.put_targets(Rule=name, Targets=[
                {"Id": t["Id"], "Arn": self.stage.resolve("pipeline", t["Arn"])} for t in props["Targets"]])

    def _run_job(self, job, submitted) -> bool:
        """The local Batch runs the job; then its last attempt's log (every node's) goes to the log
        stream DescribeJobs names, where the failure classifier reads it, as on AWS."""
        succeeded = self.batch.run_moto_job(job, submitted)
        run = next((r for r in reversed(self.batch.runs) if r.job_id == job.job_id), None)
        if run is not None:
            lines = [line for log in run.attempts[-1].logs for line in log.read_text(errors="replace").splitlines()]
            group, stream = job._log_group, job.log_stream_name
            # The group may exist already: another job's (jobs of two runs may end at once).
            with contextlib.suppress(self._logs.exceptions.ResourceAlreadyExistsException):
                self._logs.create_log_group(logGroupName=group)
            self._logs.create_log_stream(logGroupName=group, logStreamName=stream)
            now = int(time.time() * 1000)
            if lines:
                self._logs.put_log_events(logGroupName=group, logStreamName=stream,
                                          logEvents=[{"timestamp": now, "message": line} for line in lines[-500:]])
        return succeeded

    # ---- actions ---------------------------------------------------------------------------
    def upload_dataset(self, dataset: str, version: str, source: Path, marker: str = "_SUCCESS",
                       team: str | None = None) -> str:
        """Upload every file under `source` to incoming/[<team>/]<dataset>/<version>/, the marker last."""
        prefix = f"{TeamPaths(team).incoming_prefix}{dataset}/{version}/"
        for path in sorted(p for p in Path(source).rglob("*") if p.is_file() and p.name != marker):
            self.s3.upload_file(str(path), self.buckets["data_bucket"], prefix + path.relative_to(source).as_posix())
        self.s3.put_object(Bucket=self.buckets["data_bucket"], Key=prefix + marker, Body=b"")
        return prefix + marker

    def import_data_repository(self) -> None:
        """FSx auto-import, locally: data bucket incoming/ objects appear under /fsx/data/."""
        root = self.batch.setup.fsx_root / "data"
        paginator = self.s3.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.buckets["data_bucket"], Prefix=DATA_REPOSITORY_PREFIX):
            for obj in page.get("Contents", []):
                target = root / obj["Key"]
                if target.exists() and target.stat().st_size == obj["Size"]:
                    continue
                target.parent.mkdir(parents=True, exist_ok=True)
                self.s3.download_file(self.buckets["data_bucket"], obj["Key"], str(target))

    def start_run(self, name: str, run_input: dict[str, Any]) -> RunResult:
        """A run started by hand (`aws stepfunctions start-execution`), once it has finished."""
        self.sfn.start_execution(stateMachineArn=self.pipeline_arn, name=name, input=json.dumps(run_input))
        return self.wait_for_run(name)

    def run_canary(self, timeout_s: float = 600.0) -> JobRun:
        """The canary as its schedule submits it (no parameters: run_id "latest"), once it has finished."""
        job_id = self._batch_api.submit_job(jobName=CANARY.name, jobQueue=self._queue_arns[SINGLE_NODE_QUEUE],
                                            jobDefinition=self._definition_arns[CANARY.name])["jobId"]
        deadline = time.monotonic() + timeout_s
        while self._batch_api.describe_jobs(jobs=[job_id])["jobs"][0]["status"] not in ("SUCCEEDED", "FAILED"):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the canary job {job_id} did not finish in {timeout_s:g} s")
            time.sleep(0.5)
        return next(run for run in self.batch.runs if run.job_id == job_id)

    def wait_for_run(self, name: str, timeout_s: float = 1200.0, team: str | None = None) -> RunResult:
        """The pipeline execution called `name` (of `team`'s pipeline), once it has finished."""
        deadline = time.monotonic() + timeout_s
        arn = f"{self.pipeline_arns[team].replace(':stateMachine:', ':execution:')}:{name}"
        while True:
            assert not self.delivery_errors, f"EventBridge could not start the starter: {self.delivery_errors}"
            try:
                desc = self.sfn.describe_execution(executionArn=arn)
            except self.sfn.exceptions.ExecutionDoesNotExist:
                desc = None
            if desc is not None and desc["status"] != "RUNNING":
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"execution {name} not finished after {timeout_s:g} s (status "
                                   f"{desc['status'] if desc else 'not started'})")
            time.sleep(0.5)
        events = self.sfn.get_execution_history(executionArn=arn, maxResults=1000)["events"]
        entered: dict[str, Any] = {}
        states: list[dict[str, Any]] = []
        for event in events:
            if "stateEnteredEventDetails" in event:
                state = event["stateEnteredEventDetails"]["name"]
                entered[state] = event["timestamp"]
                states.append({"name": state, "seconds": None})
            elif "stateExitedEventDetails" in event:
                state = event["stateExitedEventDetails"]["name"]
                for record in reversed(states):
                    if record["name"] == state and record["seconds"] is None:
                        record["seconds"] = (event["timestamp"] - entered[state]).total_seconds()
                        break
        run_id = TeamPaths(team).run_id(name)  # the execution name, for a team <team>/<name>
        jobs = [r for r in self.batch.runs if r.parameters.get("run_id") == run_id]
        return RunResult(name=name, arn=arn, status=desc["status"], states=states, jobs=jobs)

    def notifications(self) -> list[str]:
        out = self._sqs.receive_message(QueueUrl=self._inbox, MaxNumberOfMessages=10).get("Messages", [])
        return [m["Body"] for m in out]

    def read_json(self, bucket: str, key: str) -> dict:
        return json.loads(self.s3.get_object(Bucket=self.buckets[bucket], Key=key)["Body"].read())

    def run_dir(self, run_id: str) -> Path:
        return local_run_dir(self.batch.setup.fsx_root, run_id)

    def format_path(self, result: RunResult) -> str:
        """The executed path: state, job, nodes, attempts, exit codes, seconds; then the status."""
        rows = [("state", "job", "nodes", "attempts", "exit code", "seconds")]
        jobs_by_state: dict[str, list[JobRun]] = {}
        for job in result.jobs:
            jobs_by_state.setdefault(job.job_name, []).append(job)
        for state in result.states:
            jobs = jobs_by_state.pop(state["name"].lower(), [])
            seconds = "-" if state["seconds"] is None else f"{state['seconds']:.1f}"
            if not jobs:
                rows.append((state["name"], "", "", "", "", seconds))
            for job in jobs:
                label = job.definition + (f"[{job.array_index}]" if job.array_index is not None else "")
                codes = ",".join(str(a.exit_code) for a in job.attempts)
                rows.append((state["name"], label, str(job.nodes), str(len(job.attempts)), codes, f"{job.seconds:.1f}"))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
        lines.append(f"execution {result.name}: {result.status}")
        return "\n".join(lines)


def _runtime_fields(props: dict) -> dict:
    """The job definition properties the local Batch uses (the rest, e.g. roles, stays unresolved)."""
    keep: dict[str, Any] = {k: props[k] for k in ("Parameters", "RetryStrategy", "Timeout") if k in props}
    if "NodeProperties" in props:
        node = props["NodeProperties"]
        keep["NodeProperties"] = {
            "MainNode": node["MainNode"], "NumNodes": node["NumNodes"],
            "NodeRangeProperties": [{"TargetNodes": r["TargetNodes"], "Container": {
                k: r["Container"][k] for k in ("Command", "Environment") if k in r["Container"]}}
                for r in node["NodeRangeProperties"]]}
    else:
        keep["ContainerProperties"] = {k: props["ContainerProperties"][k] for k in ("Command", "Environment")
                                       if k in props["ContainerProperties"]}
    return keep
