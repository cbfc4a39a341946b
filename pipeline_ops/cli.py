# PYTHON_ARGCOMPLETE_OK
"""trainium-runs: start, watch and stop training pipeline runs on AWS, and see what they cost.

    trainium-runs [--stage dev] [--team T] start --data-uri incoming/[T/]<dataset>/<version>/ [--base-model RUN]
    trainium-runs [--team T] status [RUN] | runs [--max 10] | buckets | stop RUN | cost [--max 20] | --version
    trainium-runs [--team T] logs RUN STEP [--follow] [--node N] | why [RUN]

RUN is the run id (the execution name) or an execution ARN; `--json` for scripts. In a stage with
teams every command acts on one team's pipeline (--team, env TRAINIUM_TEAM). docs/operations.md
explains each command, the stack outputs and prices it reads, and the exit codes: 0 ok, 1 AWS API
error, 2 usage, 3 unknown run/log/job, 4 wrong stage, 5 no credentials, 6 run name taken.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from datetime import datetime, timezone
from typing import Any, Callable, Iterator

from pipeline_steps import cost as cost_lib
from pipeline_steps.completion import autocomplete, version_line
from pipeline_steps.contract import CHECKPOINTS_DIR, FSX_DATA, TeamPaths, run_path
from pipeline_steps.diagnosis import handler as diagnosis, job_logs

from . import runs as R

DEFAULT_PROJECT = "TrnEmbed"


class ConflictError(R.OpsError):
    exit_code = 6


class UsageError(R.OpsError):
    exit_code = 2


# ---- AWS context ----------------------------------------------------------------------------------
class Context:
    """Clients, the resolved state machine and the price table for one CLI call."""

    def __init__(self, args: argparse.Namespace) -> None:
        import boto3

        self.args = args
        self.session = boto3.Session(profile_name=args.profile, region_name=args.region)
        if not self.session.region_name:
            raise R.ConfigError("no AWS region: pass --region or set AWS_REGION / AWS_DEFAULT_REGION.")
        self.region = self.session.region_name
        self.stack_name = self.stack_of("Pipeline")
        self.team: str | None = args.team or None
        self.paths = TeamPaths(self.team)
        self._clients: dict[str, Any] = {}
        self._outputs: dict[str, dict[str, str]] = {}
        self._arn: str | None = None
        self.prices = cost_lib.PriceTable(
            self.region, overrides=cost_lib.parse_overrides(args.price),
            price_list=None if args.offline_prices else cost_lib.PriceList.from_session(self.session))

    def client(self, name: str) -> Any:
        if name not in self._clients:
            self._clients[name] = self.session.client(name)
        return self._clients[name]

    def stack_of(self, role: str) -> str:
        return f"{self.args.project}-{self.args.stage}-{role}"

    def outputs(self, role: str = "Pipeline") -> dict[str, str]:
        """The outputs of the stage's stack `role` ("Pipeline", "Storage"), read once."""
        if role not in self._outputs:
            from botocore.exceptions import ClientError

            stack_name = self.stack_of(role)
            try:
                stacks = self.client("cloudformation").describe_stacks(StackName=stack_name)["Stacks"]
            except ClientError as exc:
                if "does not exist" in str(exc):
                    raise R.ConfigError(
                        f"stage {self.args.stage!r}: no stack {stack_name} in {self.region}. Is the stage "
                        f"deployed there (cdk deploy -c stage={self.args.stage})? Otherwise pass --stage, "
                        "--project, --region or --state-machine-arn.") from None
                raise
            self._outputs[role] = {o["OutputKey"]: o["OutputValue"] for o in stacks[0].get("Outputs", [])}
        return self._outputs[role]

    def bucket(self, output: str) -> str:
        """A bucket name from the Storage stack's outputs ("DataBucketName", "ArtifactsBucketName")."""
        name = self.outputs("Storage").get(output)
        if not name:
            raise R.ConfigError(f"stack {self.stack_of('Storage')} has no {output} output; redeploy the stage "
                                "(cdk deploy) to add it.")
        return name

    @property
    def state_machine_arn(self) -> str:
        if self._arn is None:
            if self.args.state_machine_arn:
                arn = self.args.state_machine_arn
                sfn = self.client("stepfunctions")
                try:
                    sfn.describe_state_machine(stateMachineArn=arn)
                except (sfn.exceptions.StateMachineDoesNotExist, sfn.exceptions.InvalidArn):
                    raise R.ConfigError(f"no state machine {arn} in {self.region}.") from None
            else:
                arn = self.team_state_machines().get(self.team)
                if not arn:
                    raise R.ConfigError(self._no_pipeline())
            self._arn = arn
        return self._arn

    def for_team(self, team: str | None, arn: str) -> "Context":
        """The same clients and prices, acting on another team's pipeline (`arn`)."""
        other = copy.copy(self)
        other.team, other.paths, other._arn = team, TeamPaths(team), arn
        return other

    def team_state_machines(self) -> dict[str | None, str]:
        """Team (None: the default team of a stage without teams) -> its pipeline's state machine
        ARN, from the Pipeline stack's outputs `StateMachineArn` / `<Team>StateMachineArn`."""
        found = {}
        for key, value in self.outputs().items():
            if key.endswith("StateMachineArn"):
                name = key.removesuffix("StateMachineArn").lower()
                found[name or None] = value
        return found

    def _no_pipeline(self) -> str:
        teams = sorted(t for t in self.team_state_machines() if t)
        if self.team is None and teams:
            return f"stage {self.args.stage!r} has teams: pass --team <one of {', '.join(teams)}> (or TRAINIUM_TEAM)."
        if self.team is not None:
            known = f"its teams are {', '.join(teams)}" if teams else "it has no teams (drop --team)"
            return f"stack {self.stack_name} has no pipeline for team {self.team!r}: {known}."
        return f"stack {self.stack_name} has no StateMachineArn output; pass --state-machine-arn."

    def instance_types(self) -> tuple[str, str]:
        """(training, single-node) instance types: flags, then stack outputs, then defaults."""
        outputs = self.outputs() if not self.args.state_machine_arn else {}
        training = (self.args.training_instance_type or outputs.get("TrainingInstanceType")
                    or R.DEFAULT_TRAINING_INSTANCE)
        single = (self.args.single_node_instance_type or outputs.get("SingleNodeInstanceType")
                  or R.DEFAULT_SINGLE_NODE_INSTANCE)
        return training, single


# ---- reading a run --------------------------------------------------------------------------------
def _describe_execution(ctx: Context, run: str) -> dict[str, Any]:
    sfn = ctx.client("stepfunctions")
    arn = R.execution_arn(ctx.state_machine_arn, run)
    try:
        return sfn.describe_execution(executionArn=arn)
    except (sfn.exceptions.ExecutionDoesNotExist, sfn.exceptions.InvalidArn):
        raise R.NotFoundError(f"unknown run {run.rsplit(':', 1)[-1]!r} in {ctx.state_machine_arn}; `trainium-runs runs` lists "
                              "recent runs.") from None


def _latest_run(ctx: Context) -> str:
    executions = ctx.client("stepfunctions").list_executions(
        stateMachineArn=ctx.state_machine_arn, maxResults=1)["executions"]
    if not executions:
        raise R.NotFoundError(f"no runs yet in {ctx.state_machine_arn}; start one with `trainium-runs start`.")
    return executions[0]["executionArn"]


def _history(ctx: Context, arn: str) -> list[dict[str, Any]]:
    pages = ctx.client("stepfunctions").get_paginator("get_execution_history").paginate(executionArn=arn)
    return [e for page in pages for e in page["events"]]


def _describe_jobs(ctx: Context, job_ids: list[str]) -> dict[str, dict[str, Any]]:
    return job_logs.describe_jobs(ctx.client("batch"), job_ids)


def _array_children(ctx: Context, job_id: str) -> list[dict[str, Any]]:
    pages = ctx.client("batch").get_paginator("list_jobs").paginate(
        arrayJobId=job_id, filters=[{"name": "AFTER_CREATED_AT", "values": ["0"]}])
    return [j for page in pages for j in page.get("jobSummaryList", [])]


def run_summary(ctx: Context, execution: dict[str, Any], *, now: float | None = None) -> dict[str, Any]:
    """Everything `status` shows about one execution (also the rows of `runs`)."""
    visits, jobs = R.parse_history(_history(ctx, execution["executionArn"]))
    records = _describe_jobs(ctx, [j.job_id for j in jobs.values() if j.job_id])
    training, single = ctx.instance_types()
    step_costs, job_rows = [], []
    for state in R.BATCH_STATES:
        job = jobs.get(state)
        if job is None:
            continue
        job.record = records.get(job.job_id or "", {})
        children = _array_children(ctx, job.job_id) if job.array_size and job.job_id else None
        step = R.job_cost(job, ctx.prices, training=training, single_node=single, children=children or None, now=now)
        step_costs.append(step)
        job_rows.append({
            "step": state, "job_id": job.job_id, "status": job.record.get("status", "SUBMITTED" if job.job_id else "-"),
            "nodes": step.nodes, "instance_type": step.instance_type,
            "started": R.iso(R._epoch(job.record.get("startedAt"))),
            "stopped": R.iso(R._epoch(job.record.get("stoppedAt"))),
            "seconds": round(step.seconds, 3), "cost_usd": step.as_dict()["cost_usd"],
            "price_source": step.price_source,
            "status_reason": job.record.get("statusReason"),
        })
    output = json.loads(execution.get("output") or "{}")
    run_input = json.loads(execution.get("input") or "{}")
    started = execution["startDate"].timestamp()
    stopped = execution["stopDate"].timestamp() if execution.get("stopDate") else None
    failure = None
    if execution["status"] in ("FAILED", "TIMED_OUT", "ABORTED"):
        # The failed step, not the Fail end state the failure path leads to.
        failed = [v for v in visits if v.outcome == "failed" and v.error and v.name != visits[-1].name] or \
            [v for v in visits if v.outcome == "failed"]
        failed_job = next((r for r in job_rows if r["status"] == "FAILED"), None)
        failure = {"status": execution["status"], "state": failed[-1].name if failed else None,
                   "error": (failed[-1].error if failed else None) or execution.get("error"),
                   "cause": (failed[-1].cause if failed else None) or execution.get("cause"),
                   "job_id": failed_job["job_id"] if failed_job else None,
                   "job_status_reason": failed_job["status_reason"] if failed_job else None}
    train = jobs.get("Train")
    progress = None
    if execution["status"] == "RUNNING" and train is not None and train.record.get("status") == "RUNNING":
        progress = train_progress(ctx, ctx.paths.run_id(execution["name"]), train.record, now=now)
    return {
        "run_id": execution["name"], "team": ctx.team, "execution_arn": execution["executionArn"],
        "status": execution["status"],
        "end_state": visits[-1].name if visits and execution["status"] != "RUNNING" else None,
        "current_state": visits[-1].name if visits and execution["status"] == "RUNNING" else None,
        "started": R.iso(started), "stopped": R.iso(stopped),
        "seconds": round((stopped or (now or time.time())) - started, 3),
        "input": run_input,
        "metrics": ((output.get("gate") or {}).get("report") or {}).get("metrics"),
        "gate_passed": ((output.get("gate") or {}).get("report") or {}).get("passed"),
        "timeline": [v.as_dict() for v in visits],
        "jobs": job_rows,
        "cost": cost_lib.run_cost(step_costs, comparison=cost_lib.GpuComparison()),
        "failure": failure,
        "train_progress": progress,
    }


def heartbeat_series(ctx: Context, run_id: str, *, start: float, end: float) -> dict[str, list[tuple[float, float]]]:
    """The run's heartbeat metrics (pipeline_steps/heartbeat.py: namespace, the [Stage, RunId]
    dimension set) between start and end, one point per minute, via CloudWatch GetMetricData."""
    from pipeline_steps import heartbeat

    dimensions = [{"Name": heartbeat.DIMENSION, "Value": ctx.args.stage},
                  {"Name": heartbeat.RUN_ID_DIMENSION, "Value": run_id}]
    stat = {heartbeat.METRIC_STEP: "Maximum"}
    queries = [{"Id": f"m{i}", "Label": name, "ReturnData": True,
                "MetricStat": {"Metric": {"Namespace": heartbeat.NAMESPACE, "MetricName": name, "Dimensions": dimensions},
                               "Period": 60, "Stat": stat.get(name, "Average")}}
               for i, (name, _) in enumerate(heartbeat.METRICS)]
    pages = ctx.client("cloudwatch").get_paginator("get_metric_data").paginate(
        MetricDataQueries=queries, StartTime=datetime.fromtimestamp(start, timezone.utc),
        EndTime=datetime.fromtimestamp(end, timezone.utc))
    series: dict[str, list[tuple[float, float]]] = {}
    for page in pages:
        for result in page["MetricDataResults"]:
            points = zip((t.timestamp() for t in result["Timestamps"]), result["Values"])
            series.setdefault(result["Label"], []).extend(points)
    return series


def train_progress(ctx: Context, run_id: str, record: dict[str, Any], *, now: float | None = None
                   ) -> dict[str, Any] | None:
    """A running Train's step, loss, tokens/s and ETA: heartbeat metrics, plus the planned step
    count from the newest progress line of the main node's log."""
    now = time.time() if now is None else now
    started = R._epoch(record.get("startedAt")) or now - 3 * 3600
    series = heartbeat_series(ctx, run_id, start=started - 60, end=now + 60)
    total = None
    main = R.main_node_job_id(record)
    main_record = _describe_jobs(ctx, [main]).get(main, {}) if main else record
    group, stream = job_logs.log_location(main_record)
    if stream:
        logs = ctx.client("logs")
        try:
            events = logs.get_log_events(logGroupName=group, logStreamName=stream, limit=200,
                                         startFromHead=False)["events"]
        except logs.exceptions.ResourceNotFoundException:
            events = []
        total = R.total_steps_from_log([e["message"] for e in events])
    return R.train_progress(series, total, now=now)


# ---- commands -------------------------------------------------------------------------------------
def _data_input(uri: str, data_bucket: Callable[[], str], paths: TeamPaths) -> dict[str, str]:
    """<incoming prefix><key> (a key in the stage's data bucket), s3://<data bucket>/<that key> or
    its FSx path -> the execution's data fields. The FSx data repository association maps
    /fsx/data <-> s3://<data bucket>/ (stacks/constructs/fsx_lustre.py), so an S3 URI must name that
    bucket; a team's data must be below its own incoming prefix (the pipeline refuses any other)."""
    prefix, fsx_dir = paths.incoming_prefix, paths.fsx_incoming
    forms = (f"use {prefix}<dataset>/<version>/ (a key in the stage's data bucket), s3://<data bucket>/{prefix}"
             f"<dataset>/<version>/ or {fsx_dir}/<dataset>/<version>")
    out: dict[str, str] = {}
    if uri.startswith("s3://"):
        bucket, _, key = uri[len("s3://"):].partition("/")
        expected = data_bucket()
        if bucket != expected:
            raise UsageError(f"--data-uri {uri!r}: bucket {bucket!r} is not the stage's data bucket {expected!r} "
                             f"(only it is linked to {FSX_DATA}); upload to s3://{expected}/{prefix}<dataset>/"
                             f"<version>/ or pass the key alone: {prefix}<dataset>/<version>/")
        out["data_s3_uri"] = uri
        out["data_uri"] = f"{FSX_DATA}/{key.strip('/')}"
    elif uri.startswith("/"):
        out["data_uri"] = uri.rstrip("/")
    elif uri.startswith(prefix):
        out["data_s3_uri"] = f"s3://{data_bucket()}/{uri}"
        out["data_uri"] = f"{FSX_DATA}/{uri.strip('/')}"
    else:
        raise UsageError(f"--data-uri {uri!r}: {forms}")
    if paths.team and not out["data_uri"].startswith(f"{fsx_dir}/"):
        raise UsageError(f"--data-uri {uri!r} is not team {paths.team}'s data: {forms}")
    rest = out["data_uri"][len(fsx_dir) + 1:].split("/") if out["data_uri"].startswith(f"{fsx_dir}/") else []
    if len(rest) >= 2:
        out["dataset"], out["version"] = rest[0], rest[1]
    return out


def cmd_start(ctx: Context, args: argparse.Namespace) -> dict[str, Any]:
    run_input: dict[str, Any] = _data_input(args.data_uri, lambda: ctx.bucket("DataBucketName"), ctx.paths)
    if ctx.team and args.share not in (None, ctx.team):
        raise UsageError(f"--share {args.share!r}: team {ctx.team}'s runs use its own share identifier {ctx.team!r}; "
                         "drop --share.")
    if args.base_model is not None:
        # A bare run id means that run's dir (checkpoint.resolve picks its newest verified checkpoint);
        # "" trains from scratch.
        base = args.base_model
        run_input["init_from"] = base if (not base or "/" in base) else run_path(ctx.paths.run_id(base))
    for key, value in (("num_nodes", args.nodes), ("share", args.share), ("priority", args.priority),
                       ("embed_shards", args.embed_shards), ("prepare_shards", args.prepare_shards)):
        if value is not None:
            run_input[key] = value
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S")
    name = args.name or R.execution_name(run_input.get("dataset", "manual"), run_input.get("version", ""),
                                         suffix=f"-{stamp}")
    sfn = ctx.client("stepfunctions")
    try:
        started = sfn.start_execution(stateMachineArn=ctx.state_machine_arn, name=name, input=json.dumps(run_input))
    except sfn.exceptions.ExecutionAlreadyExists:
        raise ConflictError(f"a run named {name!r} already exists; pick another --name "
                            f"(`trainium-runs status {name}` shows it).") from None
    return {"run_id": name, "execution_arn": started["executionArn"], "input": run_input}


def cmd_status(ctx: Context, args: argparse.Namespace) -> dict[str, Any]:
    arn = R.execution_arn(ctx.state_machine_arn, args.run) if args.run else _latest_run(ctx)
    return run_summary(ctx, _describe_execution(ctx, arn))


def cmd_runs(ctx: Context, args: argparse.Namespace) -> dict[str, Any]:
    executions = ctx.client("stepfunctions").list_executions(
        stateMachineArn=ctx.state_machine_arn, maxResults=args.max)["executions"]
    rows = []
    for execution in executions:
        summary = run_summary(ctx, _describe_execution(ctx, execution["executionArn"]))
        rows.append({k: summary[k] for k in ("run_id", "status", "end_state", "current_state", "started",
                                             "seconds", "metrics", "gate_passed")}
                    | {"cost_usd": summary["cost"]["total_usd"], "unpriced": summary["cost"]["unpriced"],
                       "price_sources": summary["cost"]["price_sources"],
                       "failed_state": (summary["failure"] or {}).get("state")})
    return {"state_machine_arn": ctx.state_machine_arn, "runs": rows}


def cmd_cost(ctx: Context, args: argparse.Namespace) -> dict[str, Any]:
    """The compute cost of each team's `--max` latest runs (the --team given, else every team of
    the stage): runs, node-hours and USD, priced like `status` (docs/operations.md, "Cost")."""
    machines = {ctx.team: ctx.state_machine_arn} if ctx.team or args.state_machine_arn else ctx.team_state_machines()
    rows = []
    for team, arn in sorted(machines.items(), key=lambda item: item[0] or ""):
        team_ctx = ctx.for_team(team, arn)
        executions = ctx.client("stepfunctions").list_executions(stateMachineArn=arn, maxResults=args.max)["executions"]
        costs = [run_summary(team_ctx, _describe_execution(team_ctx, e["executionArn"]))["cost"] for e in executions]
        rows.append({"team": team or "default", "runs": len(costs),
                     "since": R.iso(min((e["startDate"].timestamp() for e in executions), default=None)),
                     "node_hours": round(sum(c["node_hours"] for c in costs), 4),
                     "cost_usd": round(sum(c["total_usd"] for c in costs), 4),
                     "unpriced": sorted({step for c in costs for step in c["unpriced"]}),
                     "price_sources": sorted({src for c in costs for src in c["price_sources"]})})
    return {"stage": ctx.args.stage, "max_runs_per_team": args.max, "teams": rows}


TERMINAL_JOB_STATUSES = ("SUCCEEDED", "FAILED")


def _log_target(ctx: Context, args: argparse.Namespace) -> dict[str, Any]:
    """The run, step, job id, record and log stream `logs` reads (the node's or array child's)."""
    execution = _describe_execution(ctx, args.run)
    _, jobs = R.parse_history(_history(ctx, execution["executionArn"]))
    state = next(s for s in R.BATCH_STATES if s.lower() == args.step)  # argparse checked the name
    job = jobs.get(state)
    if job is None or not job.job_id:
        raise R.NotFoundError(f"run {execution['name']} has no {state} job (yet); `trainium-runs status "
                              f"{execution['name']}` shows how far it got.")
    job_id = job.job_id
    record = _describe_jobs(ctx, [job_id]).get(job_id, {})
    try:
        node_job = R.node_job_id(record, args.node)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if args.node is not None and node_job is None:
        raise UsageError(f"--node {args.node}: the {state} job {job_id} is a single-node job; drop --node.")
    if node_job:  # multi-node: the node's own job record carries its log stream
        job_id, record = node_job, _describe_jobs(ctx, [node_job]).get(node_job, {})
    elif job.array_size:
        job_id = f"{job.job_id}:{args.index}"
        record = _describe_jobs(ctx, [job_id]).get(job_id, {})
    group, stream = job_logs.log_location(record)
    if not stream:
        raise R.NotFoundError(f"{state} job {job_id} has no log stream yet (status {record.get('status', '?')}).")
    return {"run_id": execution["name"], "step": state, "job_id": job_id, "log_group": group, "log_stream": stream}


def _event(e: dict[str, Any]) -> dict[str, Any]:
    return {"timestamp": R.iso(e["timestamp"] / 1000.0), "message": e["message"]}


def cmd_logs(ctx: Context, args: argparse.Namespace) -> dict[str, Any]:
    target = _log_target(ctx, args)
    logs = ctx.client("logs")
    try:
        page = logs.get_log_events(logGroupName=target["log_group"], logStreamName=target["log_stream"],
                                   limit=args.lines, startFromHead=args.head)
    except logs.exceptions.ResourceNotFoundException:
        raise R.NotFoundError(f"log stream {target['log_group']}/{target['log_stream']} of job {target['job_id']} "
                              "not found (expired or not written yet).") from None
    events = page["events"]
    if not args.follow:
        return {**target, "events": [_event(e) for e in events]}
    out = {**target, "events": []}
    if args.json:
        print(json.dumps({k: v for k, v in out.items() if k != "events"}), flush=True)
    else:
        _print_log_header(out)
    for event in [*events, *follow(ctx, target, page["nextForwardToken"], args.interval)]:
        print(json.dumps(_event(event)) if args.json else _log_line(_event(event)), flush=True)
        out["followed"] = out.get("followed", 0) + 1
    out["job_status"] = _describe_jobs(ctx, [target["job_id"]]).get(target["job_id"], {}).get("status")
    return out


def follow(ctx: Context, target: dict[str, Any], token: str, interval: float, *,
           sleep: Callable[[float], None] = time.sleep) -> Iterator[dict[str, Any]]:
    """The stream's events after `token` as they arrive (GetLogEvents with startFromHead and the
    forward token), until the job has ended and a last read finds nothing new."""
    logs = ctx.client("logs")
    while True:
        done = _describe_jobs(ctx, [target["job_id"]]).get(target["job_id"], {}).get("status") in TERMINAL_JOB_STATUSES
        page = logs.get_log_events(logGroupName=target["log_group"], logStreamName=target["log_stream"],
                                   nextToken=token, startFromHead=True)
        yield from page["events"]
        if done and not page["events"]:
            return
        token = page["nextForwardToken"]
        sleep(interval)


# The failure path's states (stacks/constructs/pipeline_states.py): their input holds $.failure.
FAILURE_PATH_STATES = ("DiagnoseFailure", "NotifyFailure")


def _latest_failed_run(ctx: Context) -> str:
    executions = ctx.client("stepfunctions").list_executions(
        stateMachineArn=ctx.state_machine_arn, statusFilter="FAILED", maxResults=1)["executions"]
    if not executions:
        raise R.NotFoundError(f"no failed runs in {ctx.state_machine_arn}.")
    return executions[0]["executionArn"]


def _failure_event(execution: dict[str, Any], history: list[dict[str, Any]]) -> dict[str, Any]:
    """What the pipeline's classifier was given: the failure path's state input, else (a run that
    never reached it, e.g. aborted or timed out) the execution's own error and cause."""
    entered = [e["stateEnteredEventDetails"] for e in history if "stateEnteredEventDetails" in e]
    for details in reversed(entered):
        if details["name"] in FAILURE_PATH_STATES:
            event = json.loads(details.get("input") or "{}")
            if event.get("failure"):
                return event
    visits, _ = R.parse_history(history)
    state = next((v.name for v in reversed(visits) if v.error), None) or "execution"
    return {"run_id": execution["name"],
            "failure": {state: {"Error": execution.get("error") or "", "Cause": execution.get("cause") or ""}}}


def cmd_why(ctx: Context, args: argparse.Namespace) -> dict[str, Any]:
    """The failure class of a failed run, as its notification said: every node's log tail of the
    failed job (array children too), its exit code and Batch's reasons (pipeline_steps/diagnosis)."""
    arn = R.execution_arn(ctx.state_machine_arn, args.run) if args.run else _latest_failed_run(ctx)
    execution = _describe_execution(ctx, arn)
    if execution["status"] not in ("FAILED", "TIMED_OUT", "ABORTED"):
        return {"run_id": execution["name"], "status": execution["status"], "diagnosis": None}
    event = _failure_event(execution, _history(ctx, execution["executionArn"]))
    result = diagnosis.classify_failure(event, ctx.client("batch"), ctx.client("logs"))
    return {"run_id": execution["name"], "status": execution["status"], "diagnosis": result}


def cmd_buckets(ctx: Context, args: argparse.Namespace) -> dict[str, Any]:
    data, artifacts = ctx.bucket("DataBucketName"), ctx.bucket("ArtifactsBucketName")
    paths = ctx.paths
    return {"team": ctx.team, "data_bucket": data, "artifacts_bucket": artifacts,
            "upload_to": f"s3://{data}/{paths.incoming_prefix}<dataset>/<version>/",
            "runs": f"s3://{artifacts}/{paths.runs_prefix}",
            "current_model": f"s3://{artifacts}/{paths.current_model_key}"}


def cmd_stop(ctx: Context, args: argparse.Namespace) -> dict[str, Any]:
    execution = _describe_execution(ctx, args.run)
    if execution["status"] != "RUNNING":
        return {"run_id": execution["name"], "stopped": False, "status": execution["status"]}
    cause = args.cause or f"stopped by {os.environ.get('USER', 'an operator')} with trainium-runs"
    ctx.client("stepfunctions").stop_execution(executionArn=execution["executionArn"], cause=cause,
                                               error="StoppedByOperator")
    return {"run_id": execution["name"], "stopped": True, "status": "ABORTED", "cause": cause}


# ---- rendering --------------------------------------------------------------------------------------
def _hms(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def _usd(value: float | None) -> str:
    return "n/a" if value is None else f"${value:,.2f}"


_COLOUR = {"SUCCEEDED": "green", "FAILED": "red", "TIMED_OUT": "red", "ABORTED": "yellow", "RUNNING": "cyan",
           "succeeded": "green", "failed": "red", "caught": "yellow", "aborted": "yellow", "running": "cyan"}


def _c(text: Any) -> str:
    colour = _COLOUR.get(str(text))
    return f"[{colour}]{text}[/{colour}]" if colour else str(text)


def render_start(console: Any, out: dict[str, Any]) -> None:
    console.print(f"started run [bold]{out['run_id']}[/bold]")
    console.print(f"  execution {out['execution_arn']}")
    console.print(f"  input     {json.dumps(out['input'])}")
    console.print(f"follow it with: trainium-runs status {out['run_id']}")


def render_status(console: Any, out: dict[str, Any]) -> None:
    from rich.table import Table

    where = out["end_state"] or f"in {out['current_state']}"
    team = f" of team {out['team']}" if out.get("team") else ""
    console.print(f"run [bold]{out['run_id']}[/bold]{team}: {_c(out['status'])} ({where}), started {out['started']}, "
                  f"{_hms(out['seconds'])}")
    timeline = Table(title="state timeline")
    for col in ("state", "entered", "duration", "outcome"):
        timeline.add_column(col)
    for v in out["timeline"]:
        timeline.add_row(v["state"], v["entered"], _hms(v["seconds"]), _c(v["outcome"]))
    console.print(timeline)
    jobs = Table(title="Batch jobs")
    for col in ("step", "job id", "status", "nodes", "instance", "duration", "cost"):
        jobs.add_column(col, justify="right" if col in ("nodes", "duration", "cost") else "left")
    for j in out["jobs"]:
        jobs.add_row(j["step"], j["job_id"] or "-", _c(j["status"]), str(j["nodes"]), j["instance_type"],
                     _hms(j["seconds"]), _usd(j["cost_usd"]))
    console.print(jobs)
    if out.get("train_progress"):
        _render_progress(console, out["train_progress"])
    _render_cost(console, out["cost"])
    if out["metrics"]:
        console.print("gate: " + ("passed" if out["gate_passed"] else "rejected") + ", "
                      + ", ".join(f"{k}={v:.4f}" for k, v in sorted(out["metrics"].items())
                                  if isinstance(v, (int, float))))
    if out["failure"]:
        f = out["failure"]
        console.print(f"[red]failed in {f['state']}[/red]: {f['error']}")
        if f["job_id"]:
            console.print(f"  job {f['job_id']}: {f['job_status_reason'] or 'no status reason'}")
            console.print(f"  logs: trainium-runs logs {out['run_id']} {(f['state'] or '').lower()}")
        if f["cause"]:
            console.print(f"  cause: {str(f['cause'])[:500]}")


def _render_progress(console: Any, p: dict[str, Any]) -> None:
    step = f"{p['step']}/{p['total_steps']}" if p["total_steps"] else str(p["step"])
    loss = "-" if p["loss"] is None else f"{p['loss']:.4f}"
    tokens = "-" if p["tokens_per_s"] is None else f"{p['tokens_per_s']:,.0f}"
    console.print(f"train: step {step}, loss {loss}, {tokens} tokens/s, ETA {_hms(p['eta_seconds'])} "
                  f"(last heartbeat {p['heartbeat_age_seconds']:.0f} s ago)")


def _render_cost(console: Any, cost: dict[str, Any]) -> None:
    note = " so far" if cost["running"] else ""
    if cost["unpriced"]:
        note += f" (no price for: {', '.join(cost['unpriced'])}; add --price TYPE=USD)"
    console.print(f"compute cost{note}: {_usd(cost['total_usd'])} over {cost['node_hours']:.2f} node-hours")
    if cost.get("price_sources"):
        console.print(f"prices from: {'; '.join(cost['price_sources'])}")
    gpu = cost.get("gpu_comparison") or {}
    if gpu.get("gpu_cost_usd") is not None:
        console.print(f"training on {gpu['gpu_instance']} would cost about {_usd(gpu['gpu_cost_usd'])} "
                      f"(Trainium cost per unit of work = {gpu['cost_ratio']:.2f}x, seed benchmark)")


def render_runs(console: Any, out: dict[str, Any]) -> None:
    from rich.table import Table

    table = Table(title=f"recent runs of {out['state_machine_arn'].rsplit(':', 1)[-1]}")
    for col in ("run", "status", "outcome", "started", "duration", "recall@10", "cost"):
        table.add_column(col, justify="right" if col in ("duration", "cost", "recall@10") else "left")
    for r in out["runs"]:
        outcome = r["end_state"] or f"in {r['current_state']}"
        if r["failed_state"]:
            outcome = f"failed in {r['failed_state']}"
        recall = (r["metrics"] or {}).get("recall@10")
        table.add_row(r["run_id"], _c(r["status"]), outcome, r["started"], _hms(r["seconds"]),
                      "-" if recall is None else f"{recall:.4f}",
                      _usd(r["cost_usd"]) + ("+" if r["unpriced"] else ""))
    console.print(table)
    if any(r["unpriced"] for r in out["runs"]):
        console.print("+ = some steps have no price in the table for this region; add --price TYPE=USD")
    sources = sorted({source for r in out["runs"] for source in r["price_sources"]})
    if sources:
        console.print(f"prices from: {'; '.join(sources)}")


def _print_log_header(out: dict[str, Any]) -> None:
    print(f"{out['log_group']} {out['log_stream']} (job {out['job_id']})", flush=True)


def _log_line(e: dict[str, Any]) -> str:
    return f"{e['timestamp']}  {e['message']}"


def render_logs(console: Any, out: dict[str, Any]) -> None:
    if "job_status" in out:  # --follow printed the events as they came
        console.print(f"job {out['job_id']} ended: {out['job_status']}", markup=False, highlight=False)
        return
    console.print(f"[dim]{out['log_group']} {out['log_stream']} (job {out['job_id']})[/dim]")
    for e in out["events"]:
        console.print(_log_line(e), markup=False, highlight=False)


def render_stop(console: Any, out: dict[str, Any]) -> None:
    if out["stopped"]:
        console.print(f"stopped run {out['run_id']} (Step Functions terminates its running Batch job)")
    else:
        console.print(f"run {out['run_id']} is {out['status']}; nothing to stop")


def render_why(console: Any, out: dict[str, Any]) -> None:
    if out["diagnosis"] is None:
        console.print(f"run {out['run_id']} is {out['status']}; nothing to diagnose", markup=False)
        return
    console.print(f"run {out['run_id']} {out['status']}. {out['diagnosis']['text'].rstrip()}", markup=False,
                  highlight=False)


def render_cost(console: Any, out: dict[str, Any]) -> None:
    from rich.table import Table

    table = Table(title=f"compute cost per team, stage {out['stage']} (latest {out['max_runs_per_team']} runs each)")
    for col in ("team", "runs", "since", "node-hours", "cost"):
        table.add_column(col, justify="left" if col in ("team", "since") else "right")
    for row in out["teams"]:
        table.add_row(row["team"], str(row["runs"]), row["since"] or "-", f"{row['node_hours']:.2f}",
                      _usd(row["cost_usd"]) + ("+" if row["unpriced"] else ""))
    console.print(table)
    if any(row["unpriced"] for row in out["teams"]):
        console.print("+ = some steps have no price in the table for this region; add --price TYPE=USD")


def render_buckets(console: Any, out: dict[str, Any]) -> None:
    for label, key in (("data bucket", "data_bucket"), ("artifacts bucket", "artifacts_bucket"),
                       ("upload to", "upload_to"), ("runs", "runs"), ("current model", "current_model")):
        console.print(f"{label:17} {out[key]}", markup=False, highlight=False)


COMMANDS: dict[str, tuple[Callable[..., dict[str, Any]], Callable[[Any, dict[str, Any]], None]]] = {
    "start": (cmd_start, render_start), "status": (cmd_status, render_status), "runs": (cmd_runs, render_runs),
    "logs": (cmd_logs, render_logs), "stop": (cmd_stop, render_stop), "buckets": (cmd_buckets, render_buckets),
    "why": (cmd_why, render_why), "cost": (cmd_cost, render_cost),
}


# ---- argument parsing and the entry point -------------------------------------------------------------
def _common(suppress: bool) -> argparse.ArgumentParser:
    """Global options, accepted before or after the command. The subcommands' copy has no
    defaults (SUPPRESS) so an option given before the command is not reset by the subparser."""
    common = argparse.ArgumentParser(add_help=False)

    def default(value: Any) -> Any:
        return argparse.SUPPRESS if suppress else value

    common.add_argument("--stage", default=default(os.environ.get("TRAINIUM_STAGE", "dev")),
                        help="stage name (stacks/config.py STAGES; env TRAINIUM_STAGE; default dev)")
    common.add_argument("--project", default=default(DEFAULT_PROJECT), help="StageConfig.project (stack name prefix)")
    common.add_argument("--team", default=default(os.environ.get("TRAINIUM_TEAM") or None),
                        help="the team whose pipeline to act on, in a stage with teams (env TRAINIUM_TEAM)")
    common.add_argument("--region", default=default(None), help="AWS region (default: the AWS config/env)")
    common.add_argument("--profile", default=default(None), help="AWS profile")
    common.add_argument("--state-machine-arn", default=default(None), help="skip the stack lookup")
    common.add_argument("--json", action="store_true", default=default(False), help="machine-readable output")
    common.add_argument("--price", action="append", metavar="TYPE=USD", default=default(None), type=_price,
                        help="on-demand USD/hour for an instance type (repeatable; overrides the table)")
    common.add_argument("--offline-prices", action="store_true", default=default(False),
                        help="price with the committed table only (no AWS Price List API call)")
    common.add_argument("--training-instance-type", default=default(None))
    common.add_argument("--single-node-instance-type", default=default(None))
    return common


def _positive(kind: type, what: str):
    """An argparse type: `kind(text)` > 0, else a usage error (exit 2) saying `what` was expected."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = 0
        if not value > 0:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
        return value
    return parse


_positive_int = _positive(int, "a whole number >= 1")
_positive_float = _positive(float, "a number of seconds > 0")


def _price(text: str) -> str:
    try:
        cost_lib.parse_overrides([text])
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


STEP_NAMES = tuple(s.lower() for s in R.BATCH_STATES)


def build_parser() -> argparse.ArgumentParser:
    common = _common(suppress=True)
    parser = argparse.ArgumentParser(prog="trainium-runs", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter, parents=[_common(suppress=False)])
    parser.add_argument("--version", action="version", version=version_line("trainium-runs"))
    sub = parser.add_subparsers(dest="command", required=True)
    start = sub.add_parser("start", parents=[common], help="start a run")
    start.add_argument("--data-uri", required=True,
                       help="incoming/<dataset>/<version>/ (a key in the stage's data bucket), "
                            f"s3://<data bucket>/incoming/<dataset>/<version>/ or {FSX_DATA}/incoming/<dataset>/<version>")
    start.add_argument("--base-model", default=None,
                       help=f"run id, {run_path('<run>')}[/{CHECKPOINTS_DIR}/...] to start from ('' = from scratch; "
                            "default: the published model)")
    start.add_argument("--nodes", type=_positive_int, default=None, help="nodes for sanity/compile/train")
    start.add_argument("--share", default=None, help="fair-share identifier (production | experiments)")
    start.add_argument("--priority", type=int, default=None)
    start.add_argument("--embed-shards", type=_positive_int, default=None)
    start.add_argument("--prepare-shards", type=_positive_int, default=None,
                       help="children of the prepare array job (2..10000; the prepared data is the same for any count)")
    start.add_argument("--name", default=None, help="run id (default <dataset>-<version>-<UTC time>)")
    status = sub.add_parser("status", parents=[common], help="one run in detail (default: the latest)")
    status.add_argument("run", nargs="?", default=None)
    recent = sub.add_parser("runs", parents=[common], help="recent runs")
    recent.add_argument("--max", type=_positive_int, default=10)
    logs = sub.add_parser("logs", parents=[common], help="the main node's log of a step")
    logs.add_argument("run")
    logs.add_argument("step", type=str.lower, choices=STEP_NAMES, help=" | ".join(STEP_NAMES))
    logs.add_argument("--lines", type=_positive_int, default=200)
    logs.add_argument("--head", action="store_true", help="from the start of the stream (default: the end)")
    logs.add_argument("--index", type=int, default=0, help="array child for embed")
    logs.add_argument("--node", type=int, default=None, help="node N of a multi-node step (default: the main node)")
    logs.add_argument("--follow", "-f", action="store_true",
                      help="keep printing new lines until the job ends (like tail -f)")
    logs.add_argument("--interval", type=_positive_float, default=5.0, help="seconds between reads with --follow")
    why = sub.add_parser("why", parents=[common],
                         help="why a run failed: class, evidence and a fix (default: the latest failed run)")
    why.add_argument("run", nargs="?", default=None)
    sub.add_parser("buckets", parents=[common], help="the stage's (or team's) buckets and prefixes")
    cost = sub.add_parser("cost", parents=[common], help="compute cost per team of its latest runs")
    cost.add_argument("--max", type=_positive_int, default=20, help="latest runs per team")
    stop = sub.add_parser("stop", parents=[common], help="stop a running run")
    stop.add_argument("run")
    stop.add_argument("--cause", default=None)
    return parser


def main(argv: list[str] | None = None) -> int:
    from botocore.exceptions import ClientError, NoCredentialsError, PartialCredentialsError
    from botocore.exceptions import ProfileNotFound
    from rich.console import Console

    parser = build_parser()
    autocomplete(parser)
    try:
        args = parser.parse_args(argv)  # usage errors end here, before any credential lookup
    except SystemExit as exc:  # --help/--version (0) or a usage error (2): returned, like every other code
        return int(exc.code or 0)
    command, render = COMMANDS[args.command]
    err = Console(stderr=True, soft_wrap=True)  # one line per error: scripts grep it
    try:
        out = command(Context(args), args)
    except (NoCredentialsError, PartialCredentialsError) as exc:
        err.print(f"error: no AWS credentials ({exc}). Configure them (aws configure / aws sso login / "
                  "AWS_PROFILE) and retry.", markup=False)
        return R.CredentialsError.exit_code
    except ProfileNotFound as exc:
        err.print(f"error: {exc}", markup=False)
        return R.CredentialsError.exit_code
    except ValueError as exc:  # a bad --price
        err.print(f"error: {exc}", markup=False)
        return 2
    except R.OpsError as exc:
        err.print(f"error: {exc}", markup=False)
        return exc.exit_code
    except ClientError as exc:
        err.print(f"error: AWS: {exc}", markup=False)
        return 1
    if args.json:
        # `logs --follow --json` printed one object per line: its summary is one line too
        print(json.dumps(out, indent=None if getattr(args, "follow", False) else 2, default=str))
    else:
        render(Console(), out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
