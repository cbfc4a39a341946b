"""The execution input checks: every field, then the data, before any Batch job. A bad input ends in
one failure notification that lists each field to fix. Choice rules:
https://docs.aws.amazon.com/step-functions/latest/dg/state-choice.html
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from aws_cdk import aws_batch as batch
from aws_cdk import aws_s3 as s3
from aws_cdk import aws_stepfunctions as sfn

from pipeline_steps.contract import FSX_DATA, TeamPaths
from stacks.constructs.pipeline_states import PipelineStates
from stacks.constructs.prepare_states import MAX_ARRAY_SIZE, MIN_ARRAY_SIZE, SHARDS_FIELD, SHARDS_FIX


def policy_shares(queue: batch.IJobQueue) -> tuple[str, ...]:
    """The share identifiers the queue's fair-share policy defines (what the input check accepts)."""
    policy = queue.scheduling_policy
    if not isinstance(policy, batch.FairshareSchedulingPolicy) or not policy.shares:
        raise ValueError("TrainingPipeline: the training queue needs a fair-share policy with shares; every "
                         "submission names a share identifier.")
    return tuple(share.share_identifier for share in policy.shares)


@dataclass(frozen=True)
class InputRule:
    """One check of the execution input: the field, when it is valid, and what to tell the user."""

    field: str
    valid: sfn.Condition
    fix: str


def _plain_name(path: str) -> sfn.Condition:
    # Choice rules have only '*' wildcards: a non-empty string without '/' or spaces.
    return sfn.Condition.and_(
        sfn.Condition.is_string(path), sfn.Condition.not_(sfn.Condition.string_equals(path, "")),
        sfn.Condition.not_(sfn.Condition.string_matches(path, "*/*")),
        sfn.Condition.not_(sfn.Condition.string_matches(path, "* *")))


def _integer_in(path: str, text_path: str, low: int, high: int) -> sfn.Condition:
    # A comparison on a value of the wrong type is false, not an error, so IsNumeric guards the
    # range; the JSON text of an integer has no '.' or exponent.
    return sfn.Condition.and_(
        sfn.Condition.is_numeric(path),
        sfn.Condition.number_greater_than_equals(path, low), sfn.Condition.number_less_than_equals(path, high),
        *(sfn.Condition.not_(sfn.Condition.string_matches(text_path, f"*{c}*")) for c in ".eE"))


# data_uri = /fsx/data/<k1>/.../<kn>; the S3 prefix "<k1>/.../<kn>/" is rebuilt from the path's
# parts (intrinsic functions have no substring), for n = 1..MAX_DATA_DEPTH.
MAX_DATA_DEPTH = 8


def _under(path: str, root: str) -> sfn.Condition:
    """A string path below `root`, without '..' or spaces (a team's paths stay in its directories)."""
    return sfn.Condition.and_(
        sfn.Condition.is_string(path), sfn.Condition.string_matches(path, f"{root}/*"),
        sfn.Condition.not_(sfn.Condition.string_matches(path, "*..*")),
        sfn.Condition.not_(sfn.Condition.string_matches(path, "* *")))


def input_rules(shares: Sequence[str], max_nodes: int, paths: TeamPaths) -> list[InputRule]:
    """The checks of the execution input, in the order the failure notification lists them.
    `shares`: the share identifiers a run may name; `paths`: the team's (data_uri and init_from
    must stay in its directories; the default team's data_uri may name any directory of /fsx/data)."""
    run = "$.run"
    data_root = paths.fsx_incoming if paths.team else FSX_DATA
    return [
        InputRule("dataset", _plain_name(f"{run}.dataset"),
                  "dataset: a non-empty name without slashes or spaces, e.g. catalog"),
        InputRule("version", _plain_name(f"{run}.version"),
                  "version: the data version, e.g. 2026-01-05 (versions must sort as strings: "
                  "a run never replaces a model of a later version)"),
        InputRule("data_uri", _under(f"{run}.data_uri", data_root),
                  f"data_uri: the upload directory {paths.fsx_incoming}/<dataset>/<version> "
                  f"(which is s3://<data bucket>/{paths.incoming_prefix}<dataset>/<version>/)"),
        InputRule("init_from", sfn.Condition.or_(
            sfn.Condition.is_not_present(f"{run}.init_from"),
            sfn.Condition.string_equals(f"{run}.init_from", ""),
            _under(f"{run}.init_from", paths.fsx_runs)),
            f"init_from: a run directory {paths.fsx_runs}/<run id>, or an empty string to train from scratch"),
        InputRule("num_nodes", _integer_in(f"{run}.num_nodes", "$.checks.num_nodes", 1, max_nodes),
                  f"num_nodes: an integer 1..{max_nodes} (the max nodes of the training compute environment)"),
        InputRule("embed_shards", _integer_in(f"{run}.embed_shards", "$.checks.embed_shards", 2, 10_000),
                  "embed_shards: an integer 2..10000 (the size of a Batch array job)"),
        InputRule(SHARDS_FIELD, _integer_in(f"{run}.{SHARDS_FIELD}", f"$.checks.{SHARDS_FIELD}", MIN_ARRAY_SIZE,
                                            MAX_ARRAY_SIZE), SHARDS_FIX),
        InputRule("priority", _integer_in(f"{run}.priority", "$.checks.priority", 0, 9999),
                  "priority: an integer 0..9999 (Batch schedulingPriorityOverride)"),
        InputRule("share", sfn.Condition.or_(*(sfn.Condition.string_equals(f"{run}.share", s) for s in shares)),
                  f"share: one of the fair-share identifiers of the training queue ({', '.join(shares)})"),
    ]


def input_checks(states: PipelineStates, rules: Sequence[InputRule], *, data_bucket: s3.IBucket,
                 paths: TeamPaths, then: sfn.IChainable) -> sfn.IChainable:
    """PrepareInputChecks -> Check_<field> (Invalid_<field> appends the fix) ... -> InputValid
    -> the data lookup -> `then`. One failure notification lists every field to fix; the data is
    looked up only for a valid input."""
    checks = states.raw("PrepareInputChecks", {
        "Type": "Pass",
        # Integers are told from other numbers by their JSON text.
        "Parameters": {f"{name}.$": f"States.JsonToString($.run.{name})"
                       for name in ("num_nodes", "embed_shards", SHARDS_FIELD, "priority")},
        "ResultPath": "$.checks",
    })
    choices = [sfn.Choice(states.scope, f"Check_{rule.field}") for rule in rules]
    input_valid = sfn.Choice(states.scope, "InputValid")
    checks.next(choices[0])
    for rule, choice, following in zip(rules, choices, [*choices[1:], input_valid]):
        assert not set(rule.fix) & set("'{}\\"), f"{rule.field}: the fix text is an intrinsic-function literal"
        flag = states.raw(f"Invalid_{rule.field}", {
            "Type": "Pass",
            "Parameters": {"text.$": f"States.Format('{{}}{rule.fix}; ', $.problems.text)"},
            "ResultPath": "$.problems",
        })
        choice.when(rule.valid, following)
        choice.otherwise(flag)
        flag.next(following)

    input_valid.when(sfn.Condition.string_equals("$.problems.text", ""),
                     _data_lookup(states, data_bucket, paths, then=then))
    input_valid.otherwise(states.fail_with(
        "InvalidInput", "InvalidInput",
        "States.Format('The execution input has problems, fix them and start the run again: {}', $.problems.text)"))
    return checks


def _data_lookup(states: PipelineStates, data_bucket: s3.IBucket, paths: TeamPaths, *,
                 then: sfn.IChainable) -> sfn.IChainable:
    """LocateData -> DataDepth -> DataPrefix_<depth> -> ListData -> DataFound -> `then`: does the
    data bucket hold objects under the prefix data_uri names?"""
    locate = states.raw("LocateData", {
        "Type": "Pass",
        "Parameters": {
            "parts.$": "States.StringSplit($.run.data_uri, '/')",
            "depth.$": "States.ArrayLength(States.StringSplit($.run.data_uri, '/'))",
        },
        "ResultPath": "$.data",
    })
    depth = sfn.Choice(states.scope, "DataDepth")
    locate.next(depth)
    list_data = states.s3_task("ListData", "listObjectsV2", {
        "Bucket": data_bucket.bucket_name, "Prefix.$": "$.data.prefix", "MaxKeys": 1,
    }, result_selector={"key_count.$": "$.KeyCount"}, result_path="$.data.listing")
    for n in range(1, MAX_DATA_DEPTH + 1):
        parts = ", ".join(f"States.ArrayGetItem($.data.parts, {i})" for i in range(2, n + 2))
        prefix = states.raw(f"DataPrefix_{n}", {
            "Type": "Pass",
            "Parameters": {"parts.$": "$.data.parts",
                           "prefix.$": f"States.Format('{'{}/' * n}', {parts})"},
            "ResultPath": "$.data",
        })
        depth.when(sfn.Condition.number_equals("$.data.depth", n + 2), prefix)
        prefix.next(list_data)
    depth.otherwise(states.fail_with(
        "DataPathDepth", "InvalidInput",
        f"States.Format('data_uri {{}}: use a directory 1..{MAX_DATA_DEPTH} levels below {FSX_DATA}, e.g. "
        f"{paths.fsx_incoming}/<dataset>/<version>', $.run.data_uri)"))
    list_data.add_catch(states.failure, errors=["States.ALL"], result_path="$.failure.ListData")

    found = sfn.Choice(states.scope, "DataFound")
    list_data.next(found)
    found.when(sfn.Condition.number_greater_than("$.data.listing.key_count", 0), then)
    found.otherwise(states.fail_with(
        "NoData", "InvalidInput",
        f"States.Format('No objects under s3://{data_bucket.bucket_name}/{{}} (data_uri {{}}): upload the "
        f"data first, the _SUCCESS marker last, or fix data_uri.', $.data.prefix, $.run.data_uri)"))
    return locate
