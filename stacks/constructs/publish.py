"""Conditional publish: the team's pointer (models/current.json, a team's models/<team>/current.json)
names the newest model, and an older run
never replaces a newer one (conditional writes, https://docs.aws.amazon.com/AmazonS3/latest/userguide/conditional-writes.html).
"""

from __future__ import annotations

from aws_cdk import aws_s3 as s3
from aws_cdk import aws_stepfunctions as sfn

from pipeline_steps.contract import CHECKPOINTS_DIR, EMBEDDINGS_DIR, EXPORT_DIR, RUN_ID_PARAMETER, run_key, run_path
from stacks.constructs.pipeline_states import PipelineStates

EXPORT_PREFIX = run_key("{}", EXPORT_DIR) + "/"  # the run id goes in; written by the Export job (--s3-uri)
# A failed conditional write is HTTP 412 PreconditionFailed, an error the S3 SDK model does not
# name, which Step Functions reports as S3.S3Exception
# (https://docs.aws.amazon.com/step-functions/latest/dg/supported-services-awssdk.html).
S3_CONFLICT_ERRORS = ("S3.S3Exception",)
MAX_PUBLISH_CONFLICTS = 5


def publish(states: PipelineStates, artifacts_bucket: s3.IBucket, pointer_key: str) -> sfn.IChainable:
    """ReadPublishedModel -> NewerModelPublished? -> (ModelSuperseded | PointerRecord[Replace]
    -> Publish[Replacement]). The write is conditional on what was read (If-None-Match: * for
    the first model, If-Match: <ETag> to replace one), so a run that published in between
    makes the write fail with 412 and the decision is taken again on the new pointer."""
    bucket = artifacts_bucket.bucket_name
    done = sfn.Succeed(states.scope, "Done")
    published = states.notify("NotifyPublished", done, subject="Training pipeline: new model published",
                              message=f"States.Format('Run {{}} published {pointer_key}. Gate report: {{}}', "
                                      "$.run_id, States.JsonToString($.gate.report))")
    superseded = states.notify(
        "NotifySuperseded", sfn.Succeed(states.scope, "ModelSuperseded"),
        subject="Training pipeline: model not published, a newer one is live",
        message="States.Format('Run {} (data version {}) passed the gate but was not published: "
                f"{pointer_key} already holds run {{}} of data version {{}}.', $.run_id, $.run.version, "
                "$.latest.pointer.run_id, $.latest.pointer.data_version)",
    )
    read_latest = states.s3_task("ReadPublishedModel", "getObject", {"Bucket": bucket, "Key": pointer_key},
                                result_selector={"pointer.$": "States.StringToJson($.Body)", "etag.$": "$.ETag"},
                                result_path="$.latest")
    first_record, first_write = _pointer_write(states, artifacts_bucket, pointer_key, "PointerRecord", "Publish",
                                              {"IfNoneMatch": "*"})
    replace_record, replace_write = _pointer_write(states, artifacts_bucket, pointer_key, "PointerRecordReplace",
                                                   "PublishReplacement", {"IfMatch.$": "$.latest.etag"})
    read_latest.add_catch(first_record, errors=["S3.NoSuchKeyException"], result_path="$.latest")
    read_latest.add_catch(states.failure, errors=["States.ALL"], result_path="$.failure.ReadPublishedModel")

    newer = sfn.Choice(states.scope, "NewerModelPublished")
    read_latest.next(newer)
    latest_version, latest_started = "$.latest.pointer.data_version", "$.latest.pointer.started_at"
    newer.when(sfn.Condition.and_(sfn.Condition.is_string(latest_version),
                                  sfn.Condition.string_greater_than_json_path(latest_version, "$.run.version")),
               superseded)
    newer.when(sfn.Condition.and_(sfn.Condition.is_string(latest_version),
                                  sfn.Condition.string_equals_json_path(latest_version, "$.run.version"),
                                  sfn.Condition.is_timestamp(latest_started),
                                  sfn.Condition.timestamp_greater_than_json_path(latest_started, "$.started_at")),
               superseded)
    newer.otherwise(replace_record)

    # Another run published between our read and our write: count, read again, decide again.
    conflict = states.raw("PublishConflict", {
        "Type": "Pass",
        "Parameters": {"count.$": "States.MathAdd($.publish_conflicts.count, 1)"},
        "ResultPath": "$.publish_conflicts",
    })
    again = sfn.Choice(states.scope, "PublishAgain")
    conflict.next(again)
    again.when(sfn.Condition.number_less_than("$.publish_conflicts.count", MAX_PUBLISH_CONFLICTS), read_latest)
    again.otherwise(states.fail_with(
        "PublishConflicts", "PublishFailed",
        f"States.Format('{pointer_key} changed or refused the write {MAX_PUBLISH_CONFLICTS} times; last "
        f"error: {{}}', States.JsonToString($.publish_error))"))
    for write in (first_write, replace_write):
        write.add_catch(conflict, errors=list(S3_CONFLICT_ERRORS), result_path="$.publish_error")
        write.add_catch(states.failure, errors=["States.ALL"], result_path=f"$.failure.{write.state_id}")
        write.next(published)
    return read_latest


def _pointer_write(states: PipelineStates, artifacts_bucket: s3.IBucket, pointer_key: str, record_name: str,
                   write_name: str, condition: dict) -> tuple[sfn.CustomState, sfn.CustomState]:
    """The pointer to the new current model, built as JSON data (no string templating), and
    its conditional write as one object."""
    bucket = artifacts_bucket.bucket_name
    record = states.raw(record_name, {
        "Type": "Pass",
        "Parameters": {
            f"{RUN_ID_PARAMETER}.$": "$.run_id",
            # A run dir: checkpoint.resolve() picks its newest verified checkpoint.
            "checkpoint.$": f"States.Format('{run_path('{}')}', $.run_id)",
            "checkpoint_s3_uri.$": f"States.Format('s3://{bucket}/{run_key('{}', CHECKPOINTS_DIR)}/', $.run_id)",
            "embeddings_uri.$": f"States.Format('{run_path('{}', EMBEDDINGS_DIR)}', $.run_id)",
            # sentence-transformers folders (query/, product/, export.json), complete when
            # <export_uri>_SUCCESS exists (the Export job writes it last).
            "export_uri.$": export_uri(artifacts_bucket),
            "metrics.$": "$.gate.report.metrics",  # the flat metric dict (validate reads it back)
            "dataset.$": "$.run.dataset",
            "data_version.$": "$.run.version",
            "started_at.$": "$.started_at",
            "published_at.$": "$$.State.EnteredTime",
        },
        "ResultPath": "$.pointer",
    })
    write = states.s3_task(write_name, "putObject", {
        "Bucket": bucket,
        "Key": pointer_key,
        "ContentType": "application/json",
        # The SDK integration takes the body as a string.
        "Body.$": "States.JsonToString($.pointer)",
        **condition,
    }, result_path="$.published", retry_errors=("States.Timeout", "S3.SdkClientException"))
    record.next(write)
    return record, write


def export_uri(artifacts_bucket: s3.IBucket) -> str:
    """Where the Export job uploads the run's export (an intrinsic function of $.run_id)."""
    return f"States.Format('s3://{artifacts_bucket.bucket_name}/{EXPORT_PREFIX}', $.run_id)"
