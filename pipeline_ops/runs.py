"""A pipeline run as the operator sees it, read from AWS: the Step Functions execution (state
timeline, input, failure), its Batch jobs (ids, nodes, instance types, times, reasons), their cost
and the main node's CloudWatch log stream. Sources, in order of trust: the execution history (states,
the SubmitJob parameters each Batch state sent, the job ids), DescribeJobs, and the stacks' outputs.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import pipeline_contract
from pipeline_contract import HEARTBEAT_LOSS_METRIC, HEARTBEAT_STEP_METRIC, HEARTBEAT_THROUGHPUT_METRIC
from pipeline_steps import cost as cost_lib

# Batch states of the pipeline, in order; job names are the lower-cased state names. Multi-node
# ones run on the training instance type.
BATCH_STATES: tuple[str, ...] = tuple(step.state for step in pipeline_contract.PIPELINE_STEPS)
MULTI_NODE_STATES = frozenset(step.state for step in pipeline_contract.PIPELINE_STEPS if step.multi_node)
# Step Functions execution names: 1-80 of these characters (the run id is the execution name).
_NAME_OK = re.compile(r"[^A-Za-z0-9_-]+")


def execution_name(*parts: str, suffix: str = "") -> str:
    """A valid execution name (= run id) from free text: [A-Za-z0-9_-], at most 80 characters."""
    base = _NAME_OK.sub("-", "-".join(p for p in parts if p)).strip("-") or "run"
    return (base[: 80 - len(suffix)] + suffix).strip("-")


def execution_arn(state_machine_arn: str, run: str) -> str:
    if run.startswith("arn:"):
        return run
    return state_machine_arn.replace(":stateMachine:", ":execution:", 1) + f":{run}"


def _epoch(value: Any) -> float | None:
    """Batch timestamps are epoch milliseconds; Step Functions gives datetimes."""
    if value is None:
        return None
    if isinstance(value, datetime):
        return value.timestamp()
    return float(value) / 1000.0


def iso(ts: float | None) -> str | None:
    return None if ts is None else datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# ---- the execution history -----------------------------------------------------------------------
@dataclass
class StateVisit:
    name: str
    entered: float
    exited: float | None = None
    outcome: str = "running"  # succeeded | failed | running | caught
    error: str | None = None
    cause: str | None = None

    def as_dict(self) -> dict[str, Any]:
        end = self.exited
        return {"state": self.name, "entered": iso(self.entered), "exited": iso(end),
                "seconds": None if end is None else round(end - self.entered, 3), "outcome": self.outcome,
                "error": self.error, "cause": self.cause}


@dataclass
class StepJob:
    """The Batch job of one Batch state (the latest submission when the state was retried)."""

    state: str
    job_id: str | None = None
    requested_nodes: int | None = None
    array_size: int | None = None
    record: dict[str, Any] = field(default_factory=dict)  # DescribeJobs record (camelCase)


def parse_history(events: list[dict[str, Any]]) -> tuple[list[StateVisit], dict[str, StepJob]]:
    """State visits in order and the Batch job of each Batch state. The pipeline is sequential
    (no Parallel/Map), so a task event belongs to the state entered last."""
    visits: list[StateVisit] = []
    jobs: dict[str, StepJob] = {}
    current: StateVisit | None = None
    for event in events:
        ts = _epoch(event["timestamp"]) or 0.0  # every history event has a timestamp
        kind = event["type"]
        if "stateEnteredEventDetails" in event:
            current = StateVisit(event["stateEnteredEventDetails"]["name"], ts)
            visits.append(current)
        elif "stateExitedEventDetails" in event and current is not None:
            current.exited = ts
            if current.outcome == "running":
                current.outcome = "succeeded"
        elif current is None:
            continue
        elif kind in ("ExecutionSucceeded", "ExecutionFailed", "ExecutionAborted", "ExecutionTimedOut"):
            # Succeed/Fail end states have no exit event: the execution's end closes them.
            if current.exited is None:
                current.exited = ts
                current.outcome = {"ExecutionSucceeded": "succeeded", "ExecutionFailed": "failed"}.get(kind, "aborted")
        elif kind == "TaskScheduled" and event["taskScheduledEventDetails"].get("resourceType") == "batch":
            params = json.loads(event["taskScheduledEventDetails"].get("parameters") or "{}")
            jobs[current.name] = StepJob(
                current.name,
                requested_nodes=(params.get("NodeOverrides") or {}).get("NumNodes"),
                array_size=(params.get("ArrayProperties") or {}).get("Size"))
        elif kind == "TaskSubmitted" and current.name in jobs:
            out = json.loads(event["taskSubmittedEventDetails"].get("output") or "{}")
            jobs[current.name].job_id = out.get("JobId")
        elif kind in ("TaskFailed", "TaskTimedOut", "TaskStartFailed", "TaskSubmitFailed"):
            details = next(v for k, v in event.items() if k.endswith("EventDetails"))
            current.outcome, current.error, current.cause = "failed", details.get("error"), details.get("cause")
            if current.name in jobs and not jobs[current.name].job_id:
                try:  # a failed .sync task's cause is the job record
                    jobs[current.name].job_id = json.loads(current.cause or "{}").get("JobId")
                except ValueError:
                    pass
        elif kind == "TaskSucceeded" and current.name in jobs and not jobs[current.name].job_id:
            jobs[current.name].job_id = json.loads(event["taskSucceededEventDetails"].get("output") or "{}").get("JobId")
    # A failed task that another state followed was caught (e.g. ReadCurrentModel -> NoProductionModel);
    # the last state failed with the run (a Fail end state, or a task no Catch handled).
    for visit in visits[:-1]:
        if visit.outcome == "failed" and visit.exited is not None and visit.name not in BATCH_STATES:
            visit.outcome = "caught"
    return visits, jobs


# ---- jobs: nodes, instance type, cost -----------------------------------------------------------
def job_nodes(job: StepJob) -> int:
    """Nodes the job ran on: Batch's node properties, else the override the state sent, else 1;
    an array job counts each child as one node-slot (children run in parallel, each one instance)."""
    props = job.record.get("nodeProperties") or {}
    if props.get("numNodes"):
        return int(props["numNodes"])
    if job.requested_nodes:
        return int(job.requested_nodes)
    return 1


def job_instance_type(job: StepJob, *, training: str, single_node: str) -> str:
    """The instance type a multi-node job definition asks for (nodeRangeProperties), else the
    stage's instance type for that kind of step (single-node jobs do not report theirs)."""
    for node_range in (job.record.get("nodeProperties") or {}).get("nodeRangeProperties") or []:
        instance = (node_range.get("container") or {}).get("instanceType")
        if instance:
            return str(instance)
    instance = (job.record.get("container") or {}).get("instanceType")
    if instance:
        return str(instance)
    return training if job.state in MULTI_NODE_STATES else single_node


def job_cost(job: StepJob, prices: cost_lib.PriceTable, *, training: str, single_node: str,
             children: list[dict[str, Any]] | None = None, now: float | None = None) -> cost_lib.StepCost:
    instance = job_instance_type(job, training=training, single_node=single_node)
    if children:  # array job: the sum of its children's own run times
        priced = [cost_lib.step_cost(job.state, instance_type=instance, nodes=1, started_at=_epoch(c.get("startedAt")),
                                     stopped_at=_epoch(c.get("stoppedAt")), prices=prices, now=now) for c in children]
        return cost_lib.StepCost(job.state, instance, len(children), sum(p.seconds for p in priced) / len(children),
                                 prices.price(instance), running=any(p.running for p in priced),
                                 price_source=prices.source(instance))
    nodes = job_nodes(job)
    if job.array_size and not children:
        nodes = int(job.array_size)  # no child records: bound by the parent's span x size
    stopped = _epoch(job.record.get("stoppedAt"))
    if stopped is None and job.record.get("status") in ("SUCCEEDED", "FAILED"):
        stopped = _epoch(job.record.get("startedAt"))
    return cost_lib.step_cost(job.state, instance_type=instance, nodes=nodes,
                              started_at=_epoch(job.record.get("startedAt")), stopped_at=stopped,
                              prices=prices, now=now)


def main_node_job_id(record: dict[str, Any]) -> str | None:
    props = record.get("nodeProperties")
    if not props:
        return None
    return f"{record['jobId']}#{props.get('mainNode', 0)}"


def node_job_id(record: dict[str, Any], node: int | None) -> str | None:
    """The child job of node `node` of a multi-node job (`<jobId>#<node>`, whose record carries that
    node's log stream); the main node when `node` is None. ValueError for a node the job lacks."""
    props = record.get("nodeProperties")
    if not props:
        return None
    if node is None:
        return main_node_job_id(record)
    num_nodes = int(props.get("numNodes", 1))
    if not 0 <= node < num_nodes:
        raise ValueError(f"--node {node}: job {record['jobId']} has nodes 0..{num_nodes - 1}")
    return f"{record['jobId']}#{node}"


# ---- a running Train: heartbeat metrics (pipeline_steps/heartbeat.py) ------------------------------
_PROGRESS_LINE = re.compile(r"\btrain step (\d+)/(\d+)\b")  # pipeline_steps/progress.py's log line


def total_steps_from_log(messages: list[str]) -> int | None:
    """The planned step count from the newest `train step N/TOTAL` progress line, if any."""
    for message in reversed(messages):
        match = _PROGRESS_LINE.search(message)
        if match:
            return int(match.group(2))
    return None


def train_progress(series: dict[str, list[tuple[float, float]]], total_steps: int | None,
                   *, now: float) -> dict[str, Any] | None:
    """Step, loss, tokens/s and ETA of a running Train from its heartbeat series
    ({metric name: [(epoch seconds, value), ...]}), None before the first heartbeat.

    The step rate is the slope of TrainStep over the points returned (newest minus oldest), so a
    restart from a checkpoint or a slow first step only weighs as much as it lasted."""
    steps = sorted(series.get(HEARTBEAT_STEP_METRIC, []))
    if not steps:
        return None

    def latest(name: str) -> float | None:
        points = sorted(series.get(name, []))
        return points[-1][1] if points else None

    (t_first, s_first), (t_last, s_last) = steps[0], steps[-1]
    rate = (s_last - s_first) / (t_last - t_first) if t_last > t_first and s_last > s_first else None
    eta = None
    if rate and total_steps:
        eta = max(total_steps - s_last, 0) / rate
    return {"step": int(s_last), "total_steps": total_steps, "loss": latest(HEARTBEAT_LOSS_METRIC),
            "tokens_per_s": latest(HEARTBEAT_THROUGHPUT_METRIC),
            "steps_per_s": None if rate is None else round(rate, 4),
            "eta_seconds": None if eta is None else round(eta, 1),
            "last_heartbeat": iso(t_last), "heartbeat_age_seconds": round(now - t_last, 1)}
