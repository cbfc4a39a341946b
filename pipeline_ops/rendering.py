"""How `trainium-runs` prints each command's result for a person (rich tables and lines)."""

from __future__ import annotations

import json
from typing import Any

CAUSE_CHARS = 500
"""A failed Batch task's cause is its whole DescribeJobs record: the text shows the start and says so."""


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
        render_progress(console, out["train_progress"])
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
            cause = str(f["cause"])
            more = len(cause) - CAUSE_CHARS
            shown = cause if more <= 0 else f"{cause[:CAUSE_CHARS]}... ({more} more characters: --json)"
            console.print(f"  cause: {shown}")


def render_progress(console: Any, p: dict[str, Any]) -> None:
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


def print_log_header(out: dict[str, Any]) -> None:
    print(f"{out['log_group']} {out['log_stream']} (job {out['job_id']})", flush=True)


def log_line(e: dict[str, Any]) -> str:
    return f"{e['timestamp']}  {e['message']}"


def render_logs(console: Any, out: dict[str, Any]) -> None:
    if "job_status" in out:  # --follow printed the events as they came
        console.print(f"job {out['job_id']} ended: {out['job_status']}", markup=False, highlight=False)
        return
    console.print(f"[dim]{out['log_group']} {out['log_stream']} (job {out['job_id']})[/dim]")
    for e in out["events"]:
        console.print(log_line(e), markup=False, highlight=False)


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
