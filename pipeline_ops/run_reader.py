"""A run read from AWS: its execution, history, Batch jobs (with array children and node jobs),
the summary `status` and `runs` show, and a running Train's heartbeat progress."""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime
from typing import Any

from pipeline_contract import (
    HEARTBEAT_NAMESPACE,
    HEARTBEAT_RUN_DIMENSION,
    HEARTBEAT_STAGE_DIMENSION,
    HEARTBEAT_STEP_METRIC,
)
from pipeline_steps import cost as cost_lib
from pipeline_steps.diagnosis import job_logs

from . import runs
from .context import Context
from .errors import NotFoundError


def describe_execution(ctx: Context, run: str) -> dict[str, Any]:
    sfn = ctx.client("stepfunctions")
    arn = runs.execution_arn(ctx.state_machine_arn, run)
    try:
        return sfn.describe_execution(executionArn=arn)
    except (sfn.exceptions.ExecutionDoesNotExist, sfn.exceptions.InvalidArn):
        raise NotFoundError(f"unknown run {run.rsplit(':', 1)[-1]!r} in {ctx.state_machine_arn}; `trainium-runs runs` lists "
                              "recent runs.") from None


def latest_run(ctx: Context) -> str:
    executions = ctx.client("stepfunctions").list_executions(
        stateMachineArn=ctx.state_machine_arn, maxResults=1)["executions"]
    if not executions:
        raise NotFoundError(f"no runs yet in {ctx.state_machine_arn}; start one with `trainium-runs start`.")
    return executions[0]["executionArn"]


def execution_history(ctx: Context, arn: str) -> list[dict[str, Any]]:
    pages = ctx.client("stepfunctions").get_paginator("get_execution_history").paginate(executionArn=arn)
    return [e for page in pages for e in page["events"]]


def describe_jobs(ctx: Context, job_ids: list[str]) -> dict[str, dict[str, Any]]:
    return job_logs.describe_jobs(ctx.client("batch"), job_ids)


def array_children(ctx: Context, job_id: str) -> list[dict[str, Any]]:
    pages = ctx.client("batch").get_paginator("list_jobs").paginate(
        arrayJobId=job_id, filters=[{"name": "AFTER_CREATED_AT", "values": ["0"]}])
    return [j for page in pages for j in page.get("jobSummaryList", [])]


def run_summary(ctx: Context, execution: dict[str, Any], *, now: float | None = None) -> dict[str, Any]:
    """Everything `status` shows about one execution (also the rows of `runs`)."""
    visits, jobs = runs.parse_history(execution_history(ctx, execution["executionArn"]))
    records = describe_jobs(ctx, [j.job_id for j in jobs.values() if j.job_id])
    training, single = ctx.instance_types()
    step_costs, job_rows = [], []
    for state in runs.BATCH_STATES:
        job = jobs.get(state)
        if job is None:
            continue
        job.record = records.get(job.job_id or "", {})
        children = array_children(ctx, job.job_id) if job.array_size and job.job_id else None
        step = runs.job_cost(job, ctx.prices, training=training, single_node=single, children=children or None, now=now)
        step_costs.append(step)
        job_rows.append({
            "step": state, "job_id": job.job_id, "status": job.record.get("status", "SUBMITTED" if job.job_id else "-"),
            "nodes": step.nodes, "instance_type": step.instance_type,
            "started": runs.iso(runs._epoch(job.record.get("startedAt"))),
            "stopped": runs.iso(runs._epoch(job.record.get("stoppedAt"))),
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
        "started": runs.iso(started), "stopped": runs.iso(stopped),
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

    dimensions = [{"Name": HEARTBEAT_STAGE_DIMENSION, "Value": ctx.args.stage},
                  {"Name": HEARTBEAT_RUN_DIMENSION, "Value": run_id}]
    stat = {HEARTBEAT_STEP_METRIC: "Maximum"}
    queries = [{"Id": f"m{i}", "Label": name, "ReturnData": True,
                "MetricStat": {"Metric": {"Namespace": HEARTBEAT_NAMESPACE, "MetricName": name,
                                          "Dimensions": dimensions},
                               "Period": 60, "Stat": stat.get(name, "Average")}}
               for i, (name, _) in enumerate(heartbeat.METRICS)]
    pages = ctx.client("cloudwatch").get_paginator("get_metric_data").paginate(
        MetricDataQueries=queries, StartTime=datetime.fromtimestamp(start, UTC),
        EndTime=datetime.fromtimestamp(end, UTC))
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
    started = runs._epoch(record.get("startedAt")) or now - 3 * 3600
    series = heartbeat_series(ctx, run_id, start=started - 60, end=now + 60)
    total = None
    main = runs.main_node_job_id(record)
    main_record = describe_jobs(ctx, [main]).get(main, {}) if main else record
    group, stream = job_logs.log_location(main_record)
    if stream:
        logs = ctx.client("logs")
        try:
            events = logs.get_log_events(logGroupName=group, logStreamName=stream, limit=200,
                                         startFromHead=False)["events"]
        except logs.exceptions.ResourceNotFoundException:
            events = []
        total = runs.total_steps_from_log([e["message"] for e in events])
    return runs.train_progress(series, total, now=now)
