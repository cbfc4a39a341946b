"""Fine-grained assertions on the pipeline stack: definition, rules, schedule, alarms, dashboard."""

from __future__ import annotations

import json

import pytest
from aws_cdk.assertions import Match
from moto.events.models import EventPattern

from pipeline_contract import PIPELINE_STEPS
from stacks.constructs.stall_watchdog import HEARTBEAT_POLL_MINUTES
from stacks.constructs.training_pipeline import BATCH_API_ERRORS
from stacks.pipeline_config import PipelineConfig
from tests.chatbot_notification import asl_custom_notification_fields
from tests.infra.pipeline_fixtures import JOB_DEFINITIONS, QUEUE_WAIT, TEST_CONFIG, synthesized

FAKE = "X"  # every reference resolves to this: the assertions look at structure, not ARNs


class _Anything(dict):
    def __missing__(self, key):
        return FAKE


@pytest.fixture(scope="module")
def syn():
    return synthesized()


@pytest.fixture(scope="module")
def definition(syn):
    return syn.definition("TrainingPipeline", _Anything())


def _resources(syn, type_):
    return syn.template.find_resources(type_)


def _happy_path(definition: dict) -> list[str]:
    """State names from StartAt along the success branch: the first Choice rule, except at
    NewerModelPublished (whose rules are the superseded cases)."""
    states, order, name = definition["States"], [], definition["StartAt"]
    while name:
        order.append(name)
        state = states[name]
        if state["Type"] == "Choice":
            name = state["Default"] if name == "NewerModelPublished" else state["Choices"][0]["Next"]
        else:
            name = state.get("Next")
    return order


def test_batch_states_in_pipeline_order_after_the_input_checks(definition):
    order = _happy_path(definition)
    batch = [n for n in order if n in {s.state for s in PIPELINE_STEPS}]
    assert batch == ["Prepare", "PrepareShards", "PrepareFinish", "Sanity", "Compile", "Train", "Validate", "Embed",
                     "Export"]
    assert order.index("InputValid") < order.index("ListData") < order.index("ReadCurrentModel") < order.index("Prepare")
    assert order.index("GatePassed") < order.index("Embed") < order.index("Export") < order.index("PublishReplacement")


def test_no_batch_job_is_reachable_without_passing_the_input_checks(definition):
    # Every path from the start to Prepare passes DataFound (data exists) after InputValid.
    states = definition["States"]

    def paths_avoiding(node: str, blocked: str, seen: set[str]) -> bool:
        if node == "Prepare":
            return True
        if node in seen or node == blocked:
            return False
        seen.add(node)
        state = states[node]
        nexts = [state.get("Next"), state.get("Default"), *(c["Next"] for c in state.get("Choices", [])),
                 *(c["Next"] for c in state.get("Catch", []))]
        return any(paths_avoiding(n, blocked, seen) for n in nexts if n)

    assert not paths_avoiding(definition["StartAt"], "DataFound", set())
    assert not paths_avoiding(definition["StartAt"], "InputValid", set())


@pytest.mark.parametrize("step", [s.state for s in PIPELINE_STEPS])
def test_every_submit_is_sync_with_fair_share_retries_catch_and_timeout(syn, definition, step):
    state = definition["States"][step]
    assert state["Resource"] == "arn:aws:states:::batch:submitJob.sync"
    params = state["Parameters"]
    assert params["ShareIdentifier.$"] == "$.run.share"
    assert params["SchedulingPriorityOverride.$"] == "$.run.priority"
    assert params["Parameters"]["run_id.$"] == "$.run_id"
    assert params["Parameters"]["data_uri.$"] == "$.run.data_uri"
    assert params["Parameters"]["init_from.$"] == "$.run.init_from"
    (retry,) = state["Retry"]
    assert sorted(retry["ErrorEquals"]) == sorted(BATCH_API_ERRORS)
    assert retry["JitterStrategy"] == "FULL"
    assert retry["BackoffRate"] == TEST_CONFIG.retry_backoff_rate
    assert retry["IntervalSeconds"] == TEST_CONFIG.retry_interval_seconds
    assert retry["MaxDelaySeconds"] == TEST_CONFIG.retry_max_delay_seconds
    assert retry["MaxAttempts"] == TEST_CONFIG.retry_max_attempts
    (catch,) = state["Catch"]
    assert catch == {"ErrorEquals": ["States.ALL"], "ResultPath": f"$.failure.{step}", "Next": "DiagnoseFailure"}
    assert state["TimeoutSeconds"] == syn.stack.pipeline.state_timeout_minutes(_step(step)) * 60


def _step(state: str):
    return next(s for s in PIPELINE_STEPS if s.state == state)


@pytest.mark.parametrize("step", [s.state for s in PIPELINE_STEPS])
def test_every_attempt_of_a_job_fits_in_its_state_timeout(syn, definition, step):
    # Batch retries inside one SubmitJob: the state must outlast attempts x (queue wait + startup + attempt).
    job_definition = syn.deps.job_definitions[_step(step).name]
    attempts, attempt_minutes = job_definition.retry_attempts, job_definition.timeout.to_minutes()
    per_attempt = QUEUE_WAIT.to_minutes() + TEST_CONFIG.startup_minutes + attempt_minutes
    assert definition["States"][step]["TimeoutSeconds"] >= attempts * per_attempt * 60
    if step == "Train":  # 72 h attempts, 3 of them: far beyond the old 72 h state timeout
        assert definition["States"][step]["TimeoutSeconds"] > 3 * 72 * 3600


def test_multi_node_steps_share_node_count_and_queue(definition):
    for step in ("Sanity", "Compile", "Train"):
        params = definition["States"][step]["Parameters"]
        assert params["NodeOverrides"] == {"NumNodes.$": "$.run.num_nodes"}
        assert params["JobQueue"] == FAKE and "JobQueue.$" not in params  # the one training queue
    embed = definition["States"]["Embed"]["Parameters"]
    assert embed["ArrayProperties"] == {"Size.$": "$.run.embed_shards"}
    assert definition["States"]["Prepare"]["Parameters"].get("ArrayProperties") is None  # the plan: one job
    assert "gate_s3_uri.$" in definition["States"]["Validate"]["Parameters"]["Parameters"]


def test_prepare_shards_is_an_array_job_sized_by_the_input_between_plan_and_finish(definition):
    states = definition["States"]
    assert states["Prepare"]["Next"] == "PrepareShards" and states["PrepareShards"]["Next"] == "PrepareFinish"
    assert states["PrepareFinish"]["Next"] == "Sanity"
    shards = states["PrepareShards"]["Parameters"]
    assert shards["ArrayProperties"] == {"Size.$": "$.run.prepare_shards"}
    # Batch sets AWS_BATCH_JOB_ARRAY_INDEX on each child, not the size: it travels as a parameter.
    size = "States.Format('{}', $.run.prepare_shards)"
    assert shards["Parameters"]["shard_count.$"] == size
    finish = states["PrepareFinish"]["Parameters"]
    assert "ArrayProperties" not in finish and finish["Parameters"]["shard_count.$"] == size
    check = states["Check_prepare_shards"]["Choices"][0]
    assert {"Variable": "$.run.prepare_shards", "NumericGreaterThanEquals": 2} in check["And"]
    assert {"Variable": "$.run.prepare_shards", "NumericLessThanEquals": 10_000} in check["And"]


def test_export_runs_after_embed_and_the_pointer_names_its_s3_upload(definition):
    """The export reaches S3 from the Export job itself (--s3-uri), before any publish state runs,
    and models/current.json names that prefix."""
    states = definition["States"]
    assert states["Embed"]["Next"] == "Export" and states["Export"]["Next"] == "ReadPublishedModel"
    uri = f"States.Format('s3://{FAKE}/runs/{{}}/export/', $.run_id)"
    assert states["Export"]["Parameters"]["Parameters"]["export_s3_uri.$"] == uri
    for record in ("PointerRecord", "PointerRecordReplace"):
        assert states[record]["Parameters"]["export_uri.$"] == uri


def test_defaults_come_from_config_and_input_wins(definition):
    defaults = definition["States"]["Defaults"]["Result"]
    assert defaults["num_nodes"] == TEST_CONFIG.default_num_nodes
    assert defaults["share"] == TEST_CONFIG.production_share
    assert defaults["priority"] == TEST_CONFIG.default_priority
    assert defaults["embed_shards"] == TEST_CONFIG.embed_array_size
    assert defaults["prepare_shards"] == TEST_CONFIG.prepare_array_size
    assert definition["States"]["ApplyDefaults"]["Parameters"]["run.$"] == \
        "States.JsonMerge($.defaults, $$.Execution.Input, false)"


def test_production_metrics_are_always_the_gate_baseline(definition):
    # init_from from the input wins for the start; the published model's metrics win for the gate.
    assert definition["States"]["ApplyBaseline"]["Parameters"]["run.$"] == \
        "States.JsonMerge(States.JsonMerge($.baseline.start, $.run, false), $.baseline.gate, false)"
    assert "InitFromGiven" not in definition["States"]


def test_one_failure_path_classifies_notifies_then_fails(syn, definition):
    states = definition["States"]
    undelivered = set(syn.stack.pipeline.undelivered_states)
    assert undelivered == {"NotifyPublishedUndelivered", "NotifyGateFailedUndelivered", "NotifySupersededUndelivered"}
    catch_targets = {c["Next"] for s in states.values() for c in s.get("Catch", [])
                     if c["ErrorEquals"] == ["States.ALL"]} - {"Failed"}
    assert catch_targets == {"DiagnoseFailure", "DiagnosisUnavailable"} | undelivered
    assert states["NotifyFailure"]["Resource"] == "arn:aws:states:::sns:publish"
    assert states["NotifyFailure"]["Next"] == "Failed" and states["Failed"]["Type"] == "Fail"
    # A malformed document or input ends in the same notification, never in a bare Pass.
    for name in ("InvalidInput", "NoData", "MalformedCurrentModel", "MalformedGateReport", "PublishConflicts"):
        assert states[name]["Next"] == "DiagnoseFailure", name
    # Batch states retry only the Batch API errors.
    for step in PIPELINE_STEPS:
        (retry,) = states[step.state]["Retry"]
        assert sorted(retry["ErrorEquals"]) == sorted(BATCH_API_ERRORS)


def test_the_classifier_can_fail_without_hiding_the_failure_or_the_notification(definition):
    states = definition["States"]
    diagnose, unavailable = states["DiagnoseFailure"], states["DiagnosisUnavailable"]
    assert diagnose["Resource"] == "arn:aws:states:::lambda:invoke" and diagnose["Parameters"]["Payload.$"] == "$"
    assert 0 < diagnose["TimeoutSeconds"] <= 300 and diagnose["ResultPath"] == "$.diagnosis"
    (retry,) = diagnose["Retry"]
    assert "Lambda.ServiceException" in retry["ErrorEquals"] and "States.ALL" not in retry["ErrorEquals"]
    assert diagnose["Catch"] == [{"ErrorEquals": ["States.ALL"], "ResultPath": "$.diagnosis_error",
                                  "Next": "DiagnosisUnavailable"}]
    assert diagnose["Next"] == unavailable["Next"] == "NotifyFailureMessage"
    # Both leave the same fields; the raw failure is in every failure e-mail.
    assert set(diagnose["ResultSelector"]) == {"class.$", "subject.$", "text.$", "chat.$"}
    assert set(unavailable["Parameters"]) == {"class", "subject", "text.$", "chat"}
    assert set(unavailable["Parameters"]["chat"]) == {"description.$", "nextSteps.$", "keywords"}
    assert unavailable["ResultPath"] == "$.diagnosis"
    assert states["NotifyFailure"]["Parameters"]["Subject.$"] == "$.diagnosis.subject"
    text = states["NotifyFailureMessage"]["Parameters"]["text.$"]
    assert "$.diagnosis.text" in text and "States.JsonToString($.failure)" in text


def _publish_states(definition: dict) -> dict[str, dict]:
    return {n: s for n, s in definition["States"].items() if s.get("Resource") == "arn:aws:states:::sns:publish"}


def test_every_notification_sends_text_to_email_and_a_custom_notification_to_chat(syn, definition):
    watchdog = syn.definition("StallWatchdog", _Anything())
    machines = {"pipeline": definition, "watchdog": watchdog}
    published = {(m, n) for m, d in machines.items() for n in _publish_states(d)}
    assert published == {("pipeline", n) for n in ("NotifyFailure", "NotifyGateFailed", "NotifyPublished",
                                                    "NotifySuperseded")} | {("watchdog", "NotifyTerminated")}
    for machine, name in published:
        states = machines[machine]["States"]
        params = states[name]["Parameters"]
        # One Publish, a rendering per protocol: the text to e-mail (and SQS, Lambda: "default"),
        # the custom notification to https, the protocol of Chatbot's subscription.
        assert params["MessageStructure"] == "json" and "Message.$" not in params, name
        assert params["Message"] == {"default.$": "$.notification.text", "email.$": "$.notification.text",
                                     "https.$": "States.JsonToString($.notification.chat)"}, name
        # Both are built by the Pass just before it, into $.notification (nothing else of the run changes).
        message = states[f"{name}Message"]
        assert (message["Type"], message["Next"], message["ResultPath"]) == ("Pass", name, "$.notification")
        assert [n for n, s in states.items() if s.get("Next") == name] == [f"{name}Message"]
        assert set(message["Parameters"]) == {"text.$", "chat"}
        fields = asl_custom_notification_fields(message["Parameters"]["chat"])
        if name == "NotifyFailure":  # what the classifier wrote for the chat, or DiagnosisUnavailable
            assert fields == {"textType": "client-markdown", "title": "$.diagnosis.subject",
                              "description": "$.diagnosis.chat.description", "nextSteps": "$.diagnosis.chat.nextSteps",
                              "keywords": "$.diagnosis.chat.keywords"}
        else:  # the e-mail's subject over the e-mail's text
            assert fields["title"] == params["Subject"] and fields["description"] == message["Parameters"]["text.$"]


def test_the_classifier_function_is_least_privilege_and_ships_only_the_classifier(syn):
    from stacks.constructs.failure_diagnosis import CODE_EXCLUDE, HANDLER

    (function,) = _resources(syn, "AWS::Lambda::Function").values()
    props = function["Properties"]
    assert props["Handler"] == HANDLER and props["Runtime"].startswith("python3.1")
    assert props["Environment"]["Variables"] == {"METRIC_NAMESPACE": "TrainiumEmbeddings", "STAGE": "dev"}
    assert "LoggingConfig" in props  # its own (encrypted) log group, where the metric lines land
    role_id = props["Role"]["Fn::GetAtt"][0]
    statements = [s for p in _resources(syn, "AWS::IAM::Policy").values()
                  if {"Ref": role_id} in p["Properties"]["Roles"] for s in p["Properties"]["PolicyDocument"]["Statement"]]
    actions = {a for s in statements for a in (s["Action"] if isinstance(s["Action"], list) else [s["Action"]])}
    assert actions == {"batch:DescribeJobs", "batch:ListJobs", "logs:GetLogEvents", "logs:CreateLogStream",
                       "logs:PutLogEvents", "kms:Decrypt"}  # Decrypt: its environment, encrypted with the key
    assert "KmsKeyArn" in props
    (read,) = [s for s in statements if s["Action"] == "logs:GetLogEvents"]
    job_logs = syn.logical_id(syn.deps.job_log_group)
    assert job_logs in json.dumps(read["Resource"])  # the job log group only
    assert not _resources(syn, "AWS::IAM::Role")[role_id]["Properties"].get("ManagedPolicyArns")
    assert CODE_EXCLUDE[:2] == ["*", ".*"]  # everything but what the "!" patterns name
    # The state machine may invoke it, unqualified (no version wildcard).
    invoke = [s for p in _resources(syn, "AWS::IAM::Policy").values()
              for s in p["Properties"]["PolicyDocument"]["Statement"] if s["Action"] == "lambda:InvokeFunction"]
    assert invoke and all(s["Resource"] == {"Fn::GetAtt": [syn.logical_id(syn.stack.diagnosis.function), "Arn"]}
                          for s in invoke)


def test_every_s3_and_sns_task_has_a_timeout_and_retries(definition):
    tasks = {n: s for n, s in definition["States"].items()
             if s["Type"] == "Task" and (":s3:" in s["Resource"] or ":sns:" in s["Resource"])}
    assert len(tasks) >= 9
    for name, state in tasks.items():
        assert 0 < state["TimeoutSeconds"] <= 300, name
        (retry,) = state["Retry"]
        assert "States.Timeout" in retry["ErrorEquals"] and retry["MaxAttempts"] >= 1, name


def test_notification_outcomes_cannot_fail_the_run(definition):
    states = definition["States"]
    for notify, end in (("NotifyPublished", "Done"), ("NotifyGateFailed", "ModelRejected"),
                        ("NotifySuperseded", "ModelSuperseded")):
        (catch,) = states[notify]["Catch"]
        assert catch["Next"] == f"{notify}Undelivered" and states[f"{notify}Undelivered"]["Next"] == end


def test_undelivered_notifications_are_counted_and_alarmed(syn):
    (metric_filter,) = syn.template.find_resources("AWS::Logs::MetricFilter").values()
    pattern = metric_filter["Properties"]["FilterPattern"]
    for state in syn.stack.pipeline.undelivered_states:
        assert f'$.details.name = "{state}"' in pattern
    assert '$.type = "PassStateEntered"' in pattern
    name = metric_filter["Properties"]["MetricTransformations"][0]["MetricName"]
    syn.template.has_resource_properties("AWS::CloudWatch::Alarm", {"MetricName": name,
                                                                     "AlarmActions": Match.any_value()})


def test_gate_is_a_visible_choice_and_rejection_skips_embed(definition):
    gate = definition["States"]["GatePassed"]
    assert gate["Type"] == "Choice" and gate["Default"] == "NotifyGateFailedMessage"
    assert gate["Choices"][0]["Next"] == "Embed"
    assert definition["States"]["NotifyGateFailed"]["Next"] == "ModelRejected"
    assert definition["States"]["ReadGate"]["Resource"] == "arn:aws:states:::aws-sdk:s3:getObject"


def test_publish_is_a_conditional_write(definition):
    states = definition["States"]
    first, replace = states["Publish"]["Parameters"], states["PublishReplacement"]["Parameters"]
    assert states["Publish"]["Resource"] == "arn:aws:states:::aws-sdk:s3:putObject"
    assert first["Key"] == replace["Key"] == "models/current.json"
    assert first["IfNoneMatch"] == "*" and replace["IfMatch.$"] == "$.latest.etag"
    for write in ("Publish", "PublishReplacement"):
        assert states[write]["Catch"][0] == {"ErrorEquals": ["S3.S3Exception"], "ResultPath": "$.publish_error",
                                             "Next": "PublishConflict"}


def test_state_machine_logs_all_to_encrypted_group_with_tracing(syn):
    machines = _resources(syn, "AWS::StepFunctions::StateMachine")
    assert len(machines) == 4  # pipeline, starter, stall watchdog, queue-wait watchdog
    for machine in machines.values():
        props = machine["Properties"]
        assert props["TracingConfiguration"] == {"Enabled": True}
        assert props["LoggingConfiguration"]["Level"] == "ALL"
    for group in _resources(syn, "AWS::Logs::LogGroup").values():
        assert "KmsKeyId" in group["Properties"]
    syn.template.has_resource_properties("AWS::SNS::Topic", {"KmsMasterKeyId": Match.any_value()})


def test_role_is_least_privilege(syn):
    statements = [s for p in _resources(syn, "AWS::IAM::Policy").values()
                  for s in p["Properties"]["PolicyDocument"]["Statement"]]
    text = json.dumps(statements)
    assert "StepFunctionsGetEventsForBatchJobsRule" in text
    submit = [s for s in statements if s["Action"] == "batch:SubmitJob"]
    # The queues, and each job definition by name with any revision (`<name>:*`; the pipeline
    # submits by name, which Batch resolves to the latest active revision).
    resources = [r for s in submit for r in s["Resource"]]
    definitions = [r for r in resources if "job-definition/" in json.dumps(r)]
    assert submit and all("*" not in json.dumps(r) for r in resources if r not in definitions)
    names = {json.dumps(r).split("job-definition/")[1].split('"')[0] for r in definitions}
    assert names == {f"{name}:*" for name in JOB_DEFINITIONS}
    star = [s for s in statements if s["Resource"] == "*"]
    allowed = {"batch:DescribeJobs", "batch:ListJobs", "cloudwatch:GetMetricData", "xray:PutTraceSegments", "xray:PutTelemetryRecords", "xray:GetSamplingRules",
               "xray:GetSamplingTargets", "logs:CreateLogDelivery", "logs:GetLogDelivery", "logs:UpdateLogDelivery",
               "logs:DeleteLogDelivery", "logs:ListLogDeliveries", "logs:PutResourcePolicy",
               "logs:DescribeResourcePolicies", "logs:DescribeLogGroups"}
    for s in star:
        actions = s["Action"] if isinstance(s["Action"], list) else [s["Action"]]
        assert set(actions) <= allowed, s
    assert "models/current.json" in text and "validation/gate.json" in text
    # The input check may list the data bucket, nothing more.
    data_statements = [s for s in statements if s["Action"] == "s3:ListBucket"]
    assert data_statements and all(isinstance(s["Resource"], dict) for s in data_statements)
    assert not [s for s in statements if "s3:*" in json.dumps(s["Action"])]


def _statements(syn) -> list[dict]:
    return [s for p in _resources(syn, "AWS::IAM::Policy").values()
            for s in p["Properties"]["PolicyDocument"]["Statement"]]


def test_jobs_are_stopped_only_when_they_carry_this_pipelines_tags(syn):
    # The state machine (timeouts), the stall watchdog and the queue-wait watchdog stop jobs; the
    # job ids are run-time values, so the tags the submissions carry are what scopes them.
    owned = {"StringEquals": {"aws:ResourceTag/pipeline": "Pipeline"}}
    stopping = [s for s in _statements(syn) if {"batch:TerminateJob", "batch:CancelJob"} & set(
        s["Action"] if isinstance(s["Action"], list) else [s["Action"]])]
    assert len(stopping) >= 2 and all(s.get("Condition") == owned for s in stopping), stopping
    tagging = [s for s in _statements(syn) if s["Action"] == "batch:TagResource"]
    assert len(tagging) == 2  # the state machine's submissions and the canary's
    for s in tagging:
        assert s["Condition"] == {"StringEquals": {"aws:RequestTag/pipeline": "Pipeline"},
                                  "ForAllValues:StringEquals": {"aws:TagKeys": ["pipeline"]}}


def test_trigger_rule_matches_success_marker_only(syn):
    rules = [r["Properties"] for r in _resources(syn, "AWS::Events::Rule").values()
             if r["Properties"].get("EventPattern", {}).get("source") == ["aws.s3"]]
    (rule,) = rules
    # The bucket name is a cross-stack import; substitute the name the test events use.
    pattern = rule["EventPattern"] | {"detail": {"bucket": {"name": ["data-bucket"]},
                                                 "object": rule["EventPattern"]["detail"]["object"]}}
    assert pattern["detail"]["object"] == {"key": [{"wildcard": "incoming/*/_SUCCESS"}]}

    # moto 5.2.5 does not implement events:TestEventPattern, so use its EventBridge matcher
    # (the one that routes put_events to rules) directly, wildcard filters included.
    matcher = EventPattern.load(json.dumps(pattern))

    def match(key: str) -> bool:
        return matcher.matches_event({"source": "aws.s3", "detail-type": "Object Created",
                                      "detail": {"bucket": {"name": "data-bucket"}, "object": {"key": key}}})

    assert match("incoming/catalog/v1/_SUCCESS")
    assert not match("incoming/catalog/v1/products/part-0.parquet")
    assert not match("other/catalog/v1/_SUCCESS")
    assert not match("incoming/catalog/v1/_SUCCESS.tmp")


def test_stall_watchdog_and_runnable_rules(syn):
    patterns = [r["Properties"]["EventPattern"] for r in _resources(syn, "AWS::Events::Rule").values()]
    batch_rules = [p for p in patterns if p["source"] == ["aws.batch"]]
    # RUNNABLE/STARTING too: a retry's alarm must go until its own RUNNING arms it again.
    assert any(p["detail"].get("status") == ["RUNNABLE", "STARTING", "RUNNING", "SUCCEEDED", "FAILED"]
               for p in batch_rules)
    assert any(p["detail"].get("statusReason") == [{"prefix": "CAPACITY:"}, {"prefix": "MISCONFIGURATION:"},
                                                   {"prefix": "QUEUE_WAIT:"}] for p in batch_rules)
    alarm_rules = [p for p in patterns if p["source"] == ["aws.cloudwatch"]]
    assert alarm_rules[0]["detail"]["state"] == {"value": ["ALARM"]}
    watchdog = syn.definition("StallWatchdog", _Anything())
    arm = watchdog["States"]["ArmStallAlarm"]["Parameters"]
    assert arm["MetricName"] == "TrainStep" and arm["Namespace"] == "TrainiumEmbeddings"
    assert arm["TreatMissingData"] == "breaching"
    assert arm["Period"] * arm["EvaluationPeriods"] == TEST_CONFIG.stall_timeout_minutes * 60
    assert arm["DatapointsToAlarm"] == arm["EvaluationPeriods"]
    # Per run: the job's run_id parameter is the RunId the heartbeat of that job publishes, so a
    # healthy concurrent run of the same stage cannot keep a stalled one's alarm quiet.
    assert arm["Dimensions"] == [{"Name": "Stage", "Value": "dev"},
                                 {"Name": "RunId", "Value.$": "$.watch.run_id"}]
    assert watchdog["States"]["TerminateStalledJob"]["Resource"] == "arn:aws:states:::aws-sdk:batch:terminateJob"


def test_stall_alarm_is_armed_only_on_a_heartbeat_or_past_the_first_heartbeat_bound(syn):
    (machine,) = [m for lid, m in _resources(syn, "AWS::StepFunctions::StateMachine").items()
                  if lid.startswith("StallWatchdog")]
    assert machine["Properties"]["StateMachineType"] == "STANDARD"  # Express workflows end after 5 minutes
    definition = syn.definition("StallWatchdog", _Anything())
    states = definition["States"]
    poll = HEARTBEAT_POLL_MINUTES * 60
    assert states["WaitForHeartbeat"] == {"Type": "Wait", "Seconds": poll, "Next": "DescribeWatchedJob"}
    into_arm = sorted(n for n, s in states.items() if s.get("Next") == "ArmStallAlarm" or s.get("Default") ==
                      "ArmStallAlarm" or any(c["Next"] == "ArmStallAlarm" for c in s.get("Choices", [])))
    assert into_arm == ["HeartbeatSeen", "PollsLeft"]
    # A heartbeat of this run exists, or the poll budget (first_heartbeat_minutes) is spent.
    assert states["HeartbeatSeen"]["Choices"] == [
        {"Variable": "$.heartbeat.query.Values[0]", "IsPresent": True, "Next": "ArmStallAlarm"}]
    assert states["PollsLeft"]["Default"] == "ArmStallAlarm"
    waited = (states["WatchRecord"]["Parameters"]["polls_left"] + 1) * poll
    assert TEST_CONFIG.first_heartbeat_minutes * 60 <= waited < TEST_CONFIG.first_heartbeat_minutes * 60 + poll
    # Polled only while the same attempt runs.
    assert [n for n, s in states.items() if any(c["Next"] == "ReadFirstHeartbeat" for c in s.get("Choices", []))] \
        == ["StillThisAttempt"]
    assert definition["TimeoutSeconds"] > waited  # the execution outlives its polls


def test_every_job_of_both_queues_waits_at_most_the_queue_wait_bound(syn):
    # The queues' own time limit acts only on the job at their head; each RUNNABLE job of either
    # queue starts the queue-wait watchdog, which waits exactly the bound the state timeouts assume.
    patterns = [r["Properties"]["EventPattern"] for r in _resources(syn, "AWS::Events::Rule").values()]
    (runnable,) = [p for p in patterns if p.get("detail", {}).get("status") == ["RUNNABLE"]]
    assert len(runnable["detail"]["jobQueue"]) == 2
    states = syn.definition("QueueWait", _Anything())["States"]
    assert states["WaitQueueBound"]["Seconds"] == QUEUE_WAIT.to_seconds()
    assert states["CancelWaitingJob"]["Resource"] == "arn:aws:states:::aws-sdk:batch:cancelJob"
    assert states["CancelWaitingJob"]["Parameters"]["Reason"].startswith("QUEUE_WAIT: ")


def test_canary_schedule_and_alarm(syn):
    (schedule,) = _resources(syn, "AWS::Scheduler::Schedule").values()
    props = schedule["Properties"]
    assert props["ScheduleExpression"] == "rate(1 hour)"
    assert ":scheduler:::aws-sdk:batch:submitJob" in json.dumps(props["Target"]["Arn"])
    assert "ShareIdentifier" in json.dumps(props["Target"]["Input"])

def test_canary_alarm_stays_ok_after_a_deploy_and_fires_when_submitted_canaries_do_not_succeed(syn):
    # Right after a deploy no canary ran yet: the success metric has no data. The alarm must not
    # treat that as an outage, but two submitted canaries without a success are one.
    (schedule,) = _resources(syn, "AWS::Scheduler::Schedule").values()
    ((group_id, group),) = _resources(syn, "AWS::Scheduler::ScheduleGroup").items()
    group_name = group["Properties"]["Name"]
    assert schedule["Properties"]["GroupName"] == group_name and group_id in schedule.get("DependsOn", [])
    alarms = [a["Properties"] for a in _resources(syn, "AWS::CloudWatch::Alarm").values()
              if "canary" in a["Properties"].get("AlarmDescription", "")]
    (alarm,) = alarms
    assert alarm["TreatMissingData"] == "notBreaching"
    assert alarm["ComparisonOperator"] == "GreaterThanOrEqualToThreshold" and alarm["Threshold"] == 1
    by_id = {m["Id"]: m for m in alarm["Metrics"]}
    assert by_id["submitted"]["MetricStat"]["Metric"]["MetricName"] == "InvocationAttemptCount"
    assert by_id["submitted"]["MetricStat"]["Metric"]["Dimensions"] == [{"Name": "ScheduleGroup",
                                                                         "Value": group_name}]
    assert by_id["succeeded"]["MetricStat"]["Metric"]["MetricName"] == "TriggeredRules"
    assert all(by_id[k]["MetricStat"]["Period"] == 7200 for k in ("submitted", "succeeded"))
    (expression,) = [m for m in alarm["Metrics"] if "Expression" in m]
    assert expression["Expression"] == "IF(FILL(submitted, 0) >= 2 AND FILL(succeeded, 0) < 1, 1, 0)"
    assert alarm["AlarmActions"]


def test_every_alarm_notifies_the_topic(syn):
    alarms = _resources(syn, "AWS::CloudWatch::Alarm")
    assert len(alarms) >= 7
    for alarm in alarms.values():
        assert alarm["Properties"]["AlarmActions"], alarm


def test_dashboard_has_the_operational_widgets(syn):
    (dashboard,) = _resources(syn, "AWS::CloudWatch::Dashboard").values()
    body = json.dumps(dashboard["Properties"]["DashboardBody"])
    for title in ("Pipeline executions by status", "Per-step duration", "Queue activity", "Training loss",
                  "Throughput tokens/s", "Alarms (incl. canary)"):
        assert title in body
    assert "TrainLoss" in body and "TokensPerSecond" in body
    # Loss/throughput/progress graphs: one line per run (the per-run dimension set).
    assert body.count("{TrainiumEmbeddings,Stage,RunId}") == 3
    # Failed runs by class over time: one line per class of the classifier's metric.
    assert "Failed runs by class" in body
    assert "SEARCH('{TrainiumEmbeddings,Stage,Class} MetricName=" in body and "PipelineFailures" in body
    assert "'Sum', 3600)" in body


def test_a_failing_classifier_is_alarmed(syn):
    alarms = [a["Properties"] for a in _resources(syn, "AWS::CloudWatch::Alarm").values()
              if a["Properties"].get("MetricName") == "Errors" and a["Properties"].get("Namespace") == "AWS/Lambda"]
    (alarm,) = alarms
    assert "unclassified" in alarm["AlarmDescription"] and alarm["AlarmActions"]


def test_canary_can_be_disabled():
    from tests.infra.pipeline_fixtures import template
    t = template(PipelineConfig(canary_interval_minutes=None))
    t.resource_count_is("AWS::Scheduler::Schedule", 0)


@pytest.mark.parametrize("kwargs, match", [
    ({"default_num_nodes": 0}, "default_num_nodes"),
    ({"default_priority": 10_000}, "default_priority"),
    ({"embed_array_size": 1}, "embed_array_size"),
    ({"prepare_array_size": 10_001}, "prepare_array_size=10001: a Batch array job has 2..10000"),
    ({"production_share": "has space"}, "production_share"),
    ({"canary_interval_minutes": 1}, "canary_interval_minutes"),
    ({"stall_timeout_minutes": 2}, "stall_timeout_minutes"),
    ({"incoming_prefix": "/incoming"}, "incoming_prefix"),
    ({"notification_email": "nobody"}, "notification_email"),
    ({"retry_backoff_rate": 0.5}, "retry_backoff_rate"),
    ({"startup_minutes": 4}, "startup_minutes=4: use 5..360"),
    ({"startup_minutes": 70, "stall_timeout_minutes": 30}, "first_heartbeat_minutes=120: use 130..1440"),
    ({"mlflow_tracking": "Managed"}, r"mlflow_tracking='Managed': use 'managed'"),
    ({"mlflow_tracking": "mlflow.example.com"}, r"a tracking URI with a scheme"),
    ({"mlflow_tracking": ""}, r"mlflow_tracking=''"),
    ({"mlflow_server_size": "small"}, r"mlflow_server_size='small': use one of \('Small', 'Medium', 'Large'\)"),
])
def test_config_validation_has_fix_it_messages(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PipelineConfig(**kwargs)
