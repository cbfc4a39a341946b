"""The quality gate: before Prepare, the published model's metrics become the run's baseline (and,
unless the input names init_from, its starting point); after Validate, the gate report decides.
S3 GetObject through the SDK integration:
https://docs.aws.amazon.com/step-functions/latest/dg/supported-services-awssdk.html
"""

from __future__ import annotations

from aws_cdk import aws_s3 as s3
from aws_cdk import aws_stepfunctions as sfn

from pipeline_steps.contract import GATE_REPORT, RUN_ID_PARAMETER, VALIDATION_METRICS, run_key, run_path
from stacks.constructs.pipeline_states import PipelineStates


def production_baseline(states: PipelineStates, artifacts_bucket: s3.IBucket, pointer_key: str, *,
                        then: sfn.IChainable) -> sfn.IChainable:
    """ReadCurrentModel -> CurrentModelValid -> UseCurrentModel | NoProductionModel -> ApplyBaseline
    -> `then`: always read, so every run is gated against production."""
    read_current = states.s3_task("ReadCurrentModel", "getObject", {
        "Bucket": artifacts_bucket.bucket_name, "Key": pointer_key,
    }, result_selector={"pointer.$": "States.StringToJson($.Body)"}, result_path="$.current")
    # A run starts from the published model unless the input names init_from; its gate
    # baseline is always the published model's metrics (ApplyBaseline: input wins for the
    # start, production wins for the baseline).
    use_current = states.raw("UseCurrentModel", {
        "Type": "Pass",
        "Parameters": {
            "start": {"init_from.$": "$.current.pointer.checkpoint"},
            "gate": {"previous_metrics.$":
                     f"States.Format('{run_path('{}', VALIDATION_METRICS)}', $.current.pointer.run_id)"},
        },
        "ResultPath": "$.baseline",
    })
    no_model = states.raw("NoProductionModel", {
        "Type": "Pass", "Result": {"start": {"init_from": ""}, "gate": {"previous_metrics": ""}},
        "ResultPath": "$.baseline",
    })
    apply_baseline = states.raw("ApplyBaseline", {
        "Type": "Pass",
        "Parameters": {
            "run.$": "States.JsonMerge(States.JsonMerge($.baseline.start, $.run, false), $.baseline.gate, false)",
            f"{RUN_ID_PARAMETER}.$": "$.run_id",
            "started_at.$": "$.started_at",
            "publish_conflicts.$": "$.publish_conflicts",
        },
    })
    # First deploy: no pointer yet (S3 returns NoSuchKey because the role may list the bucket).
    read_current.add_catch(no_model, errors=["S3.NoSuchKeyException"], result_path="$.current")
    read_current.add_catch(states.failure, errors=["States.ALL"], result_path="$.failure.ReadCurrentModel")
    pointer_valid = sfn.Choice(states.scope, "CurrentModelValid")
    read_current.next(pointer_valid)
    pointer_valid.when(sfn.Condition.and_(
        sfn.Condition.is_string("$.current.pointer.checkpoint"),
        sfn.Condition.is_string("$.current.pointer.run_id")), use_current)
    pointer_valid.otherwise(states.fail_with(
        "MalformedCurrentModel", "MalformedDocument",
        f"States.Format('s3://{artifacts_bucket.bucket_name}/{pointer_key} needs string fields checkpoint and "
        f"run_id (a pointer written by Publish); fix or restore the object, then start the run again. Got: {{}}', "
        f"States.JsonToString($.current.pointer))"))
    use_current.next(apply_baseline)
    no_model.next(apply_baseline)
    apply_baseline.next(then)
    return read_current


def gate(states: PipelineStates, artifacts_bucket: s3.IBucket, *, passed: sfn.IChainable) -> sfn.IChainable:
    """ReadGate -> GateReportValid -> GatePassed -> `passed` | NotifyGateFailed -> ModelRejected.
    Validate wrote gate.json to S3 (--gate-s3-uri); read it, decide visibly."""
    read_gate = states.s3_task("ReadGate", "getObject", {
        "Bucket": artifacts_bucket.bucket_name,
        "Key.$": f"States.Format('{run_key('{}', GATE_REPORT)}', $.run_id)",
    }, result_selector={"report.$": "States.StringToJson($.Body)"}, result_path="$.gate")
    read_gate.add_catch(states.failure, errors=["States.ALL"], result_path="$.failure.ReadGate")
    report_valid = sfn.Choice(states.scope, "GateReportValid")
    read_gate.next(report_valid)
    gate = sfn.Choice(states.scope, "GatePassed")
    report_valid.when(sfn.Condition.and_(
        sfn.Condition.is_boolean("$.gate.report.passed"), sfn.Condition.is_present("$.gate.report.metrics")), gate)
    report_valid.otherwise(states.fail_with(
        "MalformedGateReport", "MalformedDocument",
        f"States.Format('{run_key('{}', GATE_REPORT)} needs a boolean passed and a metrics object (written by "
        "the validate step); got: {}', $.run_id, States.JsonToString($.gate.report))"))
    # A rejected model is the gate doing its job, not a broken pipeline: the execution
    # succeeds (so the ExecutionsFailed alarm means "something is broken"), the end state's
    # name says what happened, and the notification carries the report.
    rejected = states.notify(
        "NotifyGateFailed", sfn.Succeed(states.scope, "ModelRejected"),
        subject="Training pipeline: model rejected by the quality gate",
        message="States.Format('Run {} trained a model that failed the quality gate; the current model stays. Gate report: {}', $.run_id, States.JsonToString($.gate.report))",
    )
    gate.when(sfn.Condition.boolean_equals("$.gate.report.passed", True), passed)
    gate.otherwise(rejected)
    return read_gate
