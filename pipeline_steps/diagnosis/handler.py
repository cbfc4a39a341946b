"""The pipeline's classifier function (AWS Lambda, stacks/constructs/failure_diagnosis.py).

Event: the failure path's state input: run_id and failure = {<failed state>: {Error, Cause}}. A
failed Batch job's Cause is its DescribeJobs record: the job is described again and every node's log
tail classified; any other failure (input checks, S3 documents) is classified from Error and Cause.
Prints one CloudWatch embedded-metric-format line (PipelineFailures, dimensions Stage and Class)
and returns {class, retryable, step, node, job_id, evidence, suggestion, docs, subject, text, chat}:
`text` is the e-mail's diagnosis, `chat` the content of the Slack channel's (stacks/constructs/notifications.py).
Environment: METRIC_NAMESPACE, STAGE.
"""

from __future__ import annotations

import json
import os
import re
import time
from typing import Any

from .classifier import Diagnosis, classify
from .job_logs import diagnose_job

METRIC_NAME = "PipelineFailures"
STAGE_DIMENSION, CLASS_DIMENSION = "Stage", "Class"
_JOB_ID = re.compile(r'"jobId"\s*:\s*"([^"]+)"', re.IGNORECASE)
_SUBJECT_CHARS = 100  # SNS: ASCII, no line breaks, at most 100 characters
CHAT_DESCRIPTION_CHARS = 3000
"""The chat description's bound, a Slack section block's text limit
(https://api.slack.com/reference/block-kit/blocks#section): the classifier's evidence is bounded
(MAX_EVIDENCE lines, each cut short) and so is the note here."""
_NOTE_CHARS = 300


def failed_step(failure: Any) -> tuple[str | None, str, str]:
    """(state name, Error, Cause) of $.failure, which holds one key: the failed state's name."""
    if not isinstance(failure, dict) or not failure:
        return None, "", ""
    name, detail = next(iter(failure.items()))
    detail = detail if isinstance(detail, dict) else {"Cause": detail}
    return name, str(detail.get("Error") or ""), str(detail.get("Cause") or "")


def _cause_record(cause: str) -> dict[str, Any]:
    """A Batch Cause (its DescribeJobs record) with lower-cased keys; {} for any other Cause."""
    try:
        record = json.loads(cause)
    except ValueError:
        return {}
    return {k.lower(): v for k, v in record.items()} if isinstance(record, dict) else {}


def _cause_facts(error: str, cause: str, record: dict[str, Any]) -> tuple[int | None, str]:
    """Exit code and reasons from a Batch record, else Error and Cause as one text."""
    if not record:
        return None, f"{error}: {cause}" if error else cause
    container = {k.lower(): v for k, v in (record.get("container") or {}).items()}
    code = container.get("exitcode")
    reasons = [r for r in (record.get("statusreason"), container.get("reason")) if r]
    return (code if isinstance(code, int) else None), " | ".join([error, *reasons])


def _ascii(text: str) -> str:
    return text.encode("ascii", "replace").decode("ascii")


def _chat(run_id: str, step: str | None, where: str, diagnosis: Diagnosis, note: str | None) -> dict:
    """The content of a Chatbot custom notification (Slack markdown): the facts, the evidence as a
    code block, the suggestion and the docs as next steps."""
    lines = [f"*Failed step:* {where}", f"*Class:* `{diagnosis.cls}` ({diagnosis.retry}). {diagnosis.summary}"]
    if diagnosis.model_note:
        lines.append(f"*Decided by:* {diagnosis.model_note}")
    if diagnosis.node is not None:
        lines.append(f"*First error on:* {diagnosis.node}")
    if note:
        lines.append(f"*Note:* {note if len(note) <= _NOTE_CHARS else note[:_NOTE_CHARS - 3] + '...'}")
    if diagnosis.evidence:
        lines += ["*Evidence:*", "```", *diagnosis.evidence_lines(), "```"]
    return {"description": "\n".join(lines),
            "nextSteps": [diagnosis.suggestion, f"Docs: {diagnosis.docs}",
                          f"`trainium-runs why {run_id}`: the same diagnosis, from the job's logs"],
            "keywords": [diagnosis.cls, *([step] if step else [])]}


def _message(run_id: str, step: str | None, job_id: str | None, diagnosis: Diagnosis, note: str | None) -> dict:
    where = f"{step} (job {job_id})" if job_id else str(step)
    text = f"Failed step: {where}\n{diagnosis.text()}\n"
    if note:
        text += f"Note: {note}\n"
    subject = " ".join(f"Run {run_id} failed in {step}: {diagnosis.cls}".split())
    return {**diagnosis.as_dict(), "step": step, "job_id": job_id, "subject": _ascii(subject)[:_SUBJECT_CHARS],
            "text": _ascii(text) + "\n", "chat": _chat(run_id, step, where, diagnosis, note)}


def classify_failure(event: dict[str, Any], batch: Any, logs: Any) -> dict[str, Any]:
    """The diagnosis of the failure path's input: the notification's subject and text, and the facts."""
    step, error, cause = failed_step(event.get("failure"))
    record = _cause_record(cause)
    match = _JOB_ID.search(cause)  # a Cause cut short is no JSON, but still names the job
    job_id = record.get("jobid") or (match.group(1) if match else None)
    diagnosis, note = None, None
    if job_id:
        try:
            diagnosis = diagnose_job(batch, logs, job_id).diagnosis
        except Exception as exc:  # noqa: BLE001 -- unreadable logs must still leave the Cause's facts
            note = f"the job's logs could not be read ({type(exc).__name__}: {exc}); classified from the Cause"
    if diagnosis is None:
        exit_code, reason = _cause_facts(error, cause, record)
        diagnosis = classify([], exit_code=exit_code, status_reason=reason)
    return _message(str(event.get("run_id") or "?"), step, job_id, diagnosis, note)


def metric_line(result: dict[str, Any], *, namespace: str, stage: str, now: float | None = None) -> str:
    """One embedded-metric-format record: PipelineFailures = 1 for (Stage, Class)
    (https://docs.aws.amazon.com/AmazonCloudWatch/latest/monitoring/CloudWatch_Embedded_Metric_Format_Specification.html)."""
    return json.dumps({
        "_aws": {"Timestamp": int((time.time() if now is None else now) * 1000), "CloudWatchMetrics": [{
            "Namespace": namespace, "Dimensions": [[STAGE_DIMENSION, CLASS_DIMENSION]],
            "Metrics": [{"Name": METRIC_NAME, "Unit": "Count"}]}]},
        STAGE_DIMENSION: stage, CLASS_DIMENSION: result["class"], METRIC_NAME: 1,
        "step": result["step"], "job_id": result["job_id"], "node": result["node"], "retryable": result["retryable"],
    })


def handler(event: dict[str, Any], context: Any = None) -> dict[str, Any]:
    import boto3  # the Lambda runtime's; the classifier itself needs no AWS library

    result = classify_failure(event, boto3.client("batch"), boto3.client("logs"))
    print(metric_line(result, namespace=os.environ.get("METRIC_NAMESPACE", "TrainiumEmbeddings"),
                      stage=os.environ.get("STAGE", "unknown")), flush=True)
    return result
