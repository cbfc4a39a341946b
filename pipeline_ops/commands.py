"""The `trainium-runs` commands: each takes the Context and the parsed arguments and returns what
it found or did as a dict (printed as JSON with --json, else rendered by pipeline_ops.rendering)."""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import Any

from pipeline_contract import (
    ARTIFACTS_BUCKET_OUTPUT,
    DATA_BUCKET_OUTPUT,
    FSX_DATA,
    TeamPaths,
    execution_input,
    run_path,
)
from pipeline_steps.diagnosis import handler as diagnosis
from pipeline_steps.diagnosis import job_logs

from . import runs
from .context import Context
from .errors import ConflictError, NotFoundError, UsageError
from .rendering import log_line, print_log_header
from .run_reader import describe_execution, describe_jobs, execution_history, latest_run, run_summary


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
    run_input: dict[str, Any] = _data_input(args.data_uri, lambda: ctx.bucket(DATA_BUCKET_OUTPUT), ctx.paths)
    if ctx.team and args.share not in (None, ctx.team):
        raise UsageError(f"--share {args.share!r}: team {ctx.team}'s runs use its own share identifier {ctx.team!r}; "
                         "drop --share.")
    if args.base_model is not None:
        # A bare run id means that run's dir (checkpoint.resolve picks its newest verified checkpoint);
        # "" trains from scratch.
        base = args.base_model
        run_input["init_from"] = base if (not base or "/" in base) else run_path(ctx.paths.run_id(base))
    for key, value in ((execution_input.NUM_NODES, args.nodes), (execution_input.SHARE, args.share),
                       (execution_input.PRIORITY_FIELD, args.priority),
                       (execution_input.EMBED_SHARDS, args.embed_shards),
                       (execution_input.PREPARE_SHARDS, args.prepare_shards)):
        if value is not None:
            run_input[key] = value
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S")
    name = args.name or runs.execution_name(run_input.get("dataset", "manual"), run_input.get("version", ""),
                                         suffix=f"-{stamp}")
    sfn = ctx.client("stepfunctions")
    try:
        started = sfn.start_execution(stateMachineArn=ctx.state_machine_arn, name=name, input=json.dumps(run_input))
    except sfn.exceptions.ExecutionAlreadyExists:
        raise ConflictError(f"a run named {name!r} already exists; pick another --name "
                            f"(`trainium-runs status {name}` shows it).") from None
    return {"run_id": name, "execution_arn": started["executionArn"], "input": run_input}


def cmd_status(ctx: Context, args: argparse.Namespace) -> dict[str, Any]:
    arn = runs.execution_arn(ctx.state_machine_arn, args.run) if args.run else latest_run(ctx)
    return run_summary(ctx, describe_execution(ctx, arn))


def cmd_runs(ctx: Context, args: argparse.Namespace) -> dict[str, Any]:
    executions = ctx.client("stepfunctions").list_executions(
        stateMachineArn=ctx.state_machine_arn, maxResults=args.max)["executions"]
    rows = []
    for execution in executions:
        summary = run_summary(ctx, describe_execution(ctx, execution["executionArn"]))
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
        costs = [run_summary(team_ctx, describe_execution(team_ctx, e["executionArn"]))["cost"] for e in executions]
        rows.append({"team": team or "default", "runs": len(costs),
                     "since": runs.iso(min((e["startDate"].timestamp() for e in executions), default=None)),
                     "node_hours": round(sum(c["node_hours"] for c in costs), 4),
                     "cost_usd": round(sum(c["total_usd"] for c in costs), 4),
                     "unpriced": sorted({step for c in costs for step in c["unpriced"]}),
                     "price_sources": sorted({src for c in costs for src in c["price_sources"]})})
    return {"stage": ctx.args.stage, "max_runs_per_team": args.max, "teams": rows}


TERMINAL_JOB_STATUSES = ("SUCCEEDED", "FAILED")


def _log_target(ctx: Context, args: argparse.Namespace) -> dict[str, Any]:
    """The run, step, job id, record and log stream `logs` reads (the node's or array child's)."""
    execution = describe_execution(ctx, args.run)
    _, jobs = runs.parse_history(execution_history(ctx, execution["executionArn"]))
    state = next(s for s in runs.BATCH_STATES if s.lower() == args.step)  # argparse checked the name
    job = jobs.get(state)
    if job is None or not job.job_id:
        raise NotFoundError(f"run {execution['name']} has no {state} job (yet); `trainium-runs status "
                              f"{execution['name']}` shows how far it got.")
    job_id = job.job_id
    record = describe_jobs(ctx, [job_id]).get(job_id, {})
    try:
        node_job = runs.node_job_id(record, args.node)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if args.node is not None and node_job is None:
        raise UsageError(f"--node {args.node}: the {state} job {job_id} is a single-node job; drop --node.")
    if node_job:  # multi-node: the node's own job record carries its log stream
        job_id, record = node_job, describe_jobs(ctx, [node_job]).get(node_job, {})
    elif job.array_size:
        job_id = f"{job.job_id}:{args.index}"
        record = describe_jobs(ctx, [job_id]).get(job_id, {})
    group, stream = job_logs.log_location(record)
    if not stream:
        raise NotFoundError(f"{state} job {job_id} has no log stream yet (status {record.get('status', '?')}).")
    return {"run_id": execution["name"], "step": state, "job_id": job_id, "log_group": group, "log_stream": stream}


def _event(e: dict[str, Any]) -> dict[str, Any]:
    return {"timestamp": runs.iso(e["timestamp"] / 1000.0), "message": e["message"]}


def cmd_logs(ctx: Context, args: argparse.Namespace) -> dict[str, Any]:
    target = _log_target(ctx, args)
    logs = ctx.client("logs")
    try:
        page = logs.get_log_events(logGroupName=target["log_group"], logStreamName=target["log_stream"],
                                   limit=args.lines, startFromHead=args.head)
    except logs.exceptions.ResourceNotFoundException:
        raise NotFoundError(f"log stream {target['log_group']}/{target['log_stream']} of job {target['job_id']} "
                              "not found (expired or not written yet).") from None
    events = page["events"]
    if not args.follow:
        return {**target, "events": [_event(e) for e in events]}
    out = {**target, "events": []}
    if args.json:
        print(json.dumps({k: v for k, v in out.items() if k != "events"}), flush=True)
    else:
        print_log_header(out)
    for event in [*events, *follow(ctx, target, page["nextForwardToken"], args.interval)]:
        print(json.dumps(_event(event)) if args.json else log_line(_event(event)), flush=True)
        out["followed"] = out.get("followed", 0) + 1
    out["job_status"] = describe_jobs(ctx, [target["job_id"]]).get(target["job_id"], {}).get("status")
    return out


def follow(ctx: Context, target: dict[str, Any], token: str, interval: float, *,
           sleep: Callable[[float], None] = time.sleep) -> Iterator[dict[str, Any]]:
    """The stream's events after `token` as they arrive (GetLogEvents with startFromHead and the
    forward token), until the job has ended and a last read finds nothing new."""
    logs = ctx.client("logs")
    while True:
        done = describe_jobs(ctx, [target["job_id"]]).get(target["job_id"], {}).get("status") in TERMINAL_JOB_STATUSES
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
        raise NotFoundError(f"no failed runs in {ctx.state_machine_arn}.")
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
    visits, _ = runs.parse_history(history)
    state = next((v.name for v in reversed(visits) if v.error), None) or "execution"
    return {"run_id": execution["name"],
            "failure": {state: {"Error": execution.get("error") or "", "Cause": execution.get("cause") or ""}}}


def cmd_why(ctx: Context, args: argparse.Namespace) -> dict[str, Any]:
    """The failure class of a failed run, as its notification said: every node's log tail of the
    failed job (array children too), its exit code and Batch's reasons (pipeline_steps/diagnosis)."""
    arn = runs.execution_arn(ctx.state_machine_arn, args.run) if args.run else _latest_failed_run(ctx)
    execution = describe_execution(ctx, arn)
    if execution["status"] not in ("FAILED", "TIMED_OUT", "ABORTED"):
        return {"run_id": execution["name"], "status": execution["status"], "diagnosis": None}
    event = _failure_event(execution, execution_history(ctx, execution["executionArn"]))
    result = diagnosis.classify_failure(event, ctx.client("batch"), ctx.client("logs"))
    return {"run_id": execution["name"], "status": execution["status"], "diagnosis": result}


def cmd_buckets(ctx: Context, args: argparse.Namespace) -> dict[str, Any]:
    data, artifacts = ctx.bucket(DATA_BUCKET_OUTPUT), ctx.bucket(ARTIFACTS_BUCKET_OUTPUT)
    paths = ctx.paths
    return {"team": ctx.team, "data_bucket": data, "artifacts_bucket": artifacts,
            "upload_to": f"s3://{data}/{paths.incoming_prefix}<dataset>/<version>/",
            "runs": f"s3://{artifacts}/{paths.runs_prefix}",
            "current_model": f"s3://{artifacts}/{paths.current_model_key}"}


def cmd_stop(ctx: Context, args: argparse.Namespace) -> dict[str, Any]:
    execution = describe_execution(ctx, args.run)
    if execution["status"] != "RUNNING":
        return {"run_id": execution["name"], "stopped": False, "status": execution["status"]}
    cause = args.cause or f"stopped by {os.environ.get('USER', 'an operator')} with trainium-runs"
    ctx.client("stepfunctions").stop_execution(executionArn=execution["executionArn"], cause=cause,
                                               error="StoppedByOperator")
    return {"run_id": execution["name"], "stopped": True, "status": "ABORTED", "cause": cause}
