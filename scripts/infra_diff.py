#!/usr/bin/env python3
"""What the current code changes in the CloudFormation templates of every snapshotted stage, against
the committed snapshots (tests/infra/snapshots/) or those of a git revision: per stack what `cdk diff`
prints (IAM and security-group tables, replacements), per stage the deploy checks (changed exports,
replaced compute environments). docs/infrastructure.md, "Reviewing changes", explains the output.

    python -m scripts.infra_diff [--base origin/main] [--stage prod] [--update]   # --update = make snapshots

Replacing or removing a retained resource (the KMS key, buckets, FSx) fails the check (exit 3) and
--update refuses to write, unless acknowledged in tests/infra/acknowledged_replacements.json or with
--acknowledge STACK/LOGICAL_ID. Exit codes: 0 no differences; 1 differences to review; 2 usage
error; 3 an unacknowledged replacement or removal of a retained resource.
"""

from __future__ import annotations

import argparse
import difflib
import functools
import json
import re
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scripts.stage_synth import SNAPSHOT_STAGES, build, snapshot_path, template_json

REPO = Path(__file__).resolve().parents[1]
ACKNOWLEDGEMENTS = REPO / "tests" / "infra" / "acknowledged_replacements.json"
RETAINED = {"Retain", "RetainExceptOnCreate", "Snapshot"}
COMPUTE_ENVIRONMENT = "AWS::Batch::ComputeEnvironment"
EXIT_CHANGED, EXIT_RETAINED_REPLACED = 1, 3
_MISSING = object()

# Resource policies next to identity policies: (type, property holding the document(s)).
_POLICY_DOCUMENTS = {
    "AWS::IAM::Policy": "PolicyDocument",
    "AWS::IAM::ManagedPolicy": "PolicyDocument",
    "AWS::S3::BucketPolicy": "PolicyDocument",
    "AWS::SNS::TopicPolicy": "PolicyDocument",
    "AWS::SQS::QueuePolicy": "PolicyDocument",
    "AWS::KMS::Key": "KeyPolicy",
    "AWS::Logs::ResourcePolicy": "PolicyDocument",
}


# ---- rendering values ------------------------------------------------------------------------------
def render(value: Any) -> str:
    """A template value as a reviewer reads it: intrinsics as ${Ref} / ${Res.Attr}, lists joined."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return ", ".join(render(v) for v in value)
    if isinstance(value, dict) and len(value) == 1:
        ((key, arg),) = value.items()
        if key == "Ref":
            return "${" + str(arg) + "}"
        if key == "Fn::GetAtt":
            return "${" + (".".join(arg) if isinstance(arg, list) else str(arg)) + "}"
        if key == "Fn::Join":
            return str(arg[0]).join(render(v) for v in arg[1])
        if key == "Fn::Sub":
            return render(arg[0] if isinstance(arg, list) else arg)
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def table(headers: tuple[str, ...], rows: Iterable[tuple[str, ...]]) -> list[str]:
    rows = list(rows)
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    line = "+" + "+".join("-" * (w + 2) for w in widths) + "+"
    fmt = "| " + " | ".join(f"{{:{w}}}" for w in widths) + " |"
    return [line, fmt.format(*headers), line, *(fmt.format(*r) for r in rows), line]


def _changes(old: set[tuple[str, ...]], new: set[tuple[str, ...]]) -> list[tuple[str, ...]]:
    return sorted([("-", *r) for r in old - new] + [("+", *r) for r in new - old], key=lambda r: (r[1:], r[0]))


# ---- IAM --------------------------------------------------------------------------------------------
IAM_HEADERS = ("", "policy of", "effect", "action", "resource", "principal", "condition")


def _statements(logical_id: str, resource: dict[str, Any]) -> Iterable[tuple[str, dict[str, Any]]]:
    props, kind = resource.get("Properties", {}), resource["Type"]
    if kind == "AWS::IAM::Role":
        yield f"{logical_id} (trust)", props.get("AssumeRolePolicyDocument") or {}
        for policy in props.get("Policies", []):
            yield f"{logical_id}/{policy.get('PolicyName')}", policy.get("PolicyDocument") or {}
    elif kind in _POLICY_DOCUMENTS:
        owner = logical_id
        if kind in ("AWS::IAM::Policy", "AWS::IAM::ManagedPolicy") and props.get("Roles"):
            owner += " -> " + render(props["Roles"])
        document = props.get(_POLICY_DOCUMENTS[kind]) or {}
        yield owner, json.loads(document) if isinstance(document, str) else document


def iam_rows(template: dict[str, Any]) -> set[tuple[str, ...]]:
    rows: set[tuple[str, ...]] = set()
    for logical_id, resource in template.get("Resources", {}).items():
        for owner, document in _statements(logical_id, resource):
            statements = document.get("Statement", [])
            for st in statements if isinstance(statements, list) else [statements]:
                rows.add(
                    (
                        owner,
                        st.get("Effect", ""),
                        render(st.get("Action", st.get("NotAction", ""))),
                        render(st.get("Resource", st.get("NotResource", "")) or ""),
                        render(st.get("Principal", "")) if "Principal" in st else "",
                        render(st["Condition"]) if "Condition" in st else "",
                    )
                )
        if resource["Type"] == "AWS::IAM::Role":
            for arn in resource.get("Properties", {}).get("ManagedPolicyArns", []):
                rows.add((logical_id, "managed policy", render(arn), "", "", ""))
    return rows


# ---- security groups --------------------------------------------------------------------------------
SG_HEADERS = ("", "group", "direction", "protocol / ports", "peer")
_PEERS = (
    "CidrIp",
    "CidrIpv6",
    "SourceSecurityGroupId",
    "DestinationSecurityGroupId",
    "SourcePrefixListId",
    "DestinationPrefixListId",
)


def _rule(group: str, direction: str, rule: dict[str, Any]) -> tuple[str, ...]:
    protocol = str(rule.get("IpProtocol", ""))
    if protocol == "-1":
        ports = "all traffic"
    else:
        low, high = rule.get("FromPort"), rule.get("ToPort")
        ports = f"{protocol} {low}" if low == high else f"{protocol} {low}-{high}"
    peer = next((f"{key}={render(rule[key])}" for key in _PEERS if key in rule), "?")
    return group, direction, ports, peer


def sg_rows(template: dict[str, Any]) -> set[tuple[str, ...]]:
    rows = set()
    for logical_id, resource in template.get("Resources", {}).items():
        props, kind = resource.get("Properties", {}), resource["Type"]
        if kind == "AWS::EC2::SecurityGroup":
            rows |= {_rule(logical_id, "in", r) for r in props.get("SecurityGroupIngress", [])}
            rows |= {_rule(logical_id, "out", r) for r in props.get("SecurityGroupEgress", [])}
        elif kind in ("AWS::EC2::SecurityGroupIngress", "AWS::EC2::SecurityGroupEgress"):
            direction = "in" if kind.endswith("Ingress") else "out"
            rows.add(_rule(render(props.get("GroupId")), direction, props))
    return rows


# ---- replacements -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Replacement:
    stack: str
    logical_id: str
    type: str
    change: str  # "replaced" | "may be replaced" | "removed"
    because: str
    retained: bool

    @property
    def key(self) -> str:
        return f"{self.stack}/{self.logical_id}"

    def row(self, acknowledged: set[str]) -> tuple[str, ...]:
        verdict = ("acknowledged" if self.key in acknowledged else "NOT ACKNOWLEDGED") if self.retained else ""
        return (self.logical_id, self.type, self.change, self.because, "yes" if self.retained else "no", verdict)


REPLACEMENT_HEADERS = ("resource", "type", "change", "because of", "retained", "")


@functools.cache
def create_only_properties(resource_type: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(create-only, conditionally create-only) property paths from the resource's CloudFormation
    schema (as shipped by cfn-lint): changing one makes CloudFormation replace the resource
    (https://docs.aws.amazon.com/cloudformation-cli/latest/userguide/resource-type-schema.html)."""
    from cfnlint.schema import PROVIDER_SCHEMA_MANAGER
    from cfnlint.schema._exceptions import ResourceNotFoundError

    try:
        schema = PROVIDER_SCHEMA_MANAGER.get_resource_schema("us-east-1", resource_type).schema
    except ResourceNotFoundError:  # a type cfn-lint has no schema for: only type/id changes count
        return (), ()

    def paths(key: str) -> tuple[str, ...]:
        return tuple(p.removeprefix("/properties/") for p in schema.get(key, []) if p.startswith("/properties/"))

    return paths("createOnlyProperties"), paths("conditionalCreateOnlyProperties")


def _at(props: dict[str, Any], path: str) -> Any:
    value: Any = props
    for part in path.split("/"):
        if part == "*":
            return value  # a list of items: compare it whole
        if not isinstance(value, dict) or part not in value:
            return _MISSING
        value = value[part]
    return value


def _retained(resource: dict[str, Any]) -> bool:
    return resource.get("DeletionPolicy") in RETAINED or resource.get("UpdateReplacePolicy") in RETAINED


def replacements(stack: str, old: dict[str, Any], new: dict[str, Any]) -> list[Replacement]:
    old_res, new_res = old.get("Resources", {}), new.get("Resources", {})
    out = []
    for logical_id, before in sorted(old_res.items()):
        after, kind, retained = new_res.get(logical_id), before["Type"], _retained(before)
        if after is None:
            if retained:  # a removal of anything else shows in the resource diff; this one loses data
                out.append(
                    Replacement(
                        stack, logical_id, kind, "removed", "gone from the template (renamed construct id?)", retained
                    )
                )
            continue
        if after["Type"] != kind:
            out.append(Replacement(stack, logical_id, kind, "replaced", f"type -> {after['Type']}", retained))
            continue
        fixed, conditional = create_only_properties(kind)
        props_before, props_after = before.get("Properties", {}), after.get("Properties", {})
        if kind == COMPUTE_ENVIRONMENT and props_after.get("ReplaceComputeEnvironment") is False:
            conditional = ()  # updated in place: an infrastructure update (compute_environment_updates)
        for change, paths in (("replaced", fixed), ("may be replaced", conditional)):
            changed = [p for p in paths if _at(props_before, p) != _at(props_after, p)]
            if changed:
                out.append(Replacement(stack, logical_id, kind, change, ", ".join(changed), retained))
                break
    return out


def load_acknowledged(path: Path | None = None) -> set[str]:
    path = path or ACKNOWLEDGEMENTS
    if not path.exists():
        return set()
    entries = json.loads(path.read_text())["acknowledged"]
    for entry in entries:
        if not str(entry.get("reason", "")).strip():
            raise SystemExit(
                f"error: {path}: {entry.get('resource')!r} has no reason; say why losing or moving its data is intended"
            )
    return {entry["resource"] for entry in entries}


# ---- deploy checks: what CloudFormation refuses, what a deploy interrupts ----------------------------
# Attributes an in-place update gives a new value: a job definition update registers a new revision
# (its Ref is the ARN with the revision), a launch template update a new version.
_NEW_ON_UPDATE = {
    "AWS::Batch::JobDefinition": ("Ref", "JobDefinitionArn"),
    "AWS::EC2::LaunchTemplate": ("LatestVersionNumber",),
}
# Batch scales these in place; any other ComputeResources change replaces the instances
# (https://docs.aws.amazon.com/batch/latest/userguide/infrastructure-updates.html).
_SCALING_ONLY = {"MinvCpus", "MaxvCpus", "DesiredvCpus"}


def references(value: Any) -> set[str]:
    """ "LogicalId" (Ref) and "LogicalId.Attribute" (GetAtt, ${X.Y} in Fn::Sub) that `value` reads."""
    found: set[str] = set()
    if isinstance(value, list):
        for item in value:
            found |= references(item)
    elif isinstance(value, dict):
        for key, arg in value.items():
            if key == "Ref" and isinstance(arg, str):
                found.add(arg)
            elif key == "Fn::GetAtt":
                found.add(".".join(arg) if isinstance(arg, list) else str(arg))
            elif key == "Fn::Sub":
                text = arg[0] if isinstance(arg, list) else arg
                found |= set(re.findall(r"\$\{([^}!]+)\}", str(text)))
                found |= references(arg[1:] if isinstance(arg, list) else [])
            else:
                found |= references(arg)
    return found


def changed_values(stack: str, old: dict[str, Any], new: dict[str, Any]) -> set[str]:
    """What a deploy of `new` over `old` gives a new value: every attribute of a replaced or removed
    resource ("LogicalId.*") and the attributes an update renews (_NEW_ON_UPDATE)."""
    new_res = new.get("Resources", {})
    gone = {r.logical_id for r in replacements(stack, old, new) if r.change != "may be replaced"}
    gone |= set(old.get("Resources", {})) - set(new_res)
    out = {f"{lid}.*" for lid in gone}
    for lid, before in old.get("Resources", {}).items():
        after = new_res.get(lid)
        if after is not None and before.get("Properties") != after.get("Properties"):
            out |= {lid if attr == "Ref" else f"{lid}.{attr}" for attr in _NEW_ON_UPDATE.get(before["Type"], ())}
    return out


def _reads_changed(value: Any, changed: set[str]) -> bool:
    return any(ref in changed or f"{ref.split('.')[0]}.*" in changed for ref in references(value))


@dataclass(frozen=True)
class ExportChange:
    stack: str
    name: str
    change: str  # "changes value" | "removed"
    importers: tuple[str, ...]

    def row(self) -> tuple[str, ...]:
        return (self.name, self.change, ", ".join(self.importers))


EXPORT_HEADERS = ("export", "change", "imported by")


def export_changes(old_stage: dict[str, dict], new_stage: dict[str, dict]) -> list[ExportChange]:
    """Exports the deployed stacks (`old_stage`) import whose value the deploy changes or removes:
    CloudFormation refuses both ("You can't modify or remove an output value that is referenced
    by another stack",
    https://docs.aws.amazon.com/AWSCloudFormation/latest/TemplateReference/intrinsic-function-reference-importvalue.html)."""
    importers: dict[str, list[str]] = {}
    for stack, template in old_stage.items():
        for name in _imported(template):
            importers.setdefault(name, []).append(stack)
    found = []
    for stack, old in old_stage.items():
        new = new_stage.get(stack, {})
        changed = changed_values(stack, old, new)
        new_exports = _exports(new)
        for name, value in _exports(old).items():
            if name not in importers:
                continue
            if name not in new_exports:
                found.append(ExportChange(stack, name, "removed", tuple(importers[name])))
            elif new_exports[name] != value or _reads_changed(value, changed):
                found.append(ExportChange(stack, name, "changes value", tuple(importers[name])))
    return found


def _exports(template: dict[str, Any]) -> dict[str, Any]:
    return {out["Export"]["Name"]: out["Value"] for out in template.get("Outputs", {}).values() if "Export" in out}


def _imported(value: Any) -> set[str]:
    if isinstance(value, list):
        return set().union(*(_imported(v) for v in value)) if value else set()
    if isinstance(value, dict):
        own = {value["Fn::ImportValue"]} if isinstance(value.get("Fn::ImportValue"), str) else set()
        return own.union(*(_imported(v) for v in value.values()))
    return set()


@dataclass(frozen=True)
class InstanceReplacement:
    """A compute environment update that replaces its instances (an infrastructure update): running
    jobs keep their old instances for up to `grace_minutes`, unless `terminate_jobs`."""

    stack: str
    logical_id: str
    because: str
    terminate_jobs: bool
    grace_minutes: int

    def row(self) -> tuple[str, ...]:
        jobs = "TERMINATED" if self.terminate_jobs else f"keep running up to {self.grace_minutes} min"
        return (self.logical_id, self.because, jobs)


INSTANCE_HEADERS = ("compute environment", "because of", "running jobs")


def compute_environment_updates(stack: str, old: dict[str, Any], new: dict[str, Any]) -> list[InstanceReplacement]:
    """Updates of compute environments that replace the instances, with the UpdatePolicy they run
    under (https://docs.aws.amazon.com/batch/latest/APIReference/API_UpdatePolicy.html: default
    30 minutes, then running jobs are terminated)."""
    changed = changed_values(stack, old, new)
    found = []
    for lid, after in sorted(new.get("Resources", {}).items()):
        before = old.get("Resources", {}).get(lid)
        if after["Type"] != COMPUTE_ENVIRONMENT or before is None or before["Type"] != COMPUTE_ENVIRONMENT:
            continue
        was, now = (r["Properties"].get("ComputeResources", {}) for r in (before, after))
        because = [
            key
            for key in sorted(set(was) | set(now))
            if key not in _SCALING_ONLY and (was.get(key) != now.get(key) or _reads_changed(now.get(key), changed))
        ]
        if because:
            policy = after["Properties"].get("UpdatePolicy", {})
            found.append(
                InstanceReplacement(
                    stack,
                    lid,
                    ", ".join(because),
                    policy.get("TerminateJobsOnUpdate") is True,
                    int(policy.get("JobExecutionTimeoutMinutes", 30)),
                )
            )
    return found


def deploy_review(old_stage: dict[str, dict], new_stage: dict[str, dict]) -> list[str]:
    """The stage-wide part of the review: exports CloudFormation would refuse to change, and
    compute environments whose instances the deploy replaces."""
    out: list[str] = []
    exports = export_changes(old_stage, new_stage)
    if exports:
        out += [
            "Exports another stack imports (CloudFormation refuses to change or remove them: deploy the "
            "importing stack first, or stop importing)",
            *table(EXPORT_HEADERS, (e.row() for e in exports)),
        ]
    updates = [
        u for stack, new in new_stage.items() for u in compute_environment_updates(stack, old_stage.get(stack, {}), new)
    ]
    if updates:
        out += [
            "Compute environments whose instances the deploy replaces",
            *table(INSTANCE_HEADERS, (u.row() for u in updates)),
        ]
    return out


# ---- one stack ------------------------------------------------------------------------------------
def _lines(value: object) -> list[str]:
    return json.dumps(value, indent=1, sort_keys=True).splitlines()


def _unified(before: object, after: object) -> list[str]:
    return ["    " + ln for ln in difflib.unified_diff(_lines(before), _lines(after), lineterm="", n=2)][2:]


def diff_template(
    name: str, old: dict, new: dict, *, acknowledged: frozenset[str] = frozenset()
) -> tuple[list[str], list[Replacement]]:
    """The review text of one stack and its replacements (empty text: no difference)."""
    out: list[str] = []
    old_res, new_res = old.get("Resources", {}), new.get("Resources", {})
    for logical_id in sorted(set(old_res) | set(new_res)):
        before, after = old_res.get(logical_id), new_res.get(logical_id)
        if before == after:
            continue
        if before is None:
            out.append(f"[+] {after['Type']} {logical_id}")
        elif after is None:
            out.append(f"[-] {before['Type']} {logical_id}   (DELETED)")
        else:
            out.append(f"[~] {after['Type']} {logical_id}")
            out += _unified(before, after)
    for section in ("Parameters", "Outputs", "Conditions", "Mappings"):
        if old.get(section) != new.get(section):
            out.append(f"[~] {section}")
            out += _unified(old.get(section), new.get(section))
    for title, headers, rows in (
        ("IAM statement changes", IAM_HEADERS, _changes(iam_rows(old), iam_rows(new))),
        ("Security group rule changes", SG_HEADERS, _changes(sg_rows(old), sg_rows(new))),
    ):
        if rows:
            out += ["", title, *table(headers, rows)]
    found = replacements(name, old, new)
    if found:
        out += [
            "",
            "Replacements (CloudFormation creates a new resource and deletes the old one)",
            *table(REPLACEMENT_HEADERS, (r.row(set(acknowledged)) for r in found)),
        ]
    return ([f"Stack {name}", *out] if out else []), found


def blocking(found: Iterable[Replacement], acknowledged: set[str]) -> list[Replacement]:
    return [r for r in found if r.retained and r.key not in acknowledged]


# ---- stages -------------------------------------------------------------------------------------------
def _snapshot_at(base: str | None, path: Path) -> dict[str, Any]:
    if base is None:
        return json.loads(path.read_text()) if path.exists() else {}
    relative = path.relative_to(REPO).as_posix()
    shown = subprocess.run(["git", "show", f"{base}:{relative}"], cwd=REPO, capture_output=True, text=True)
    return json.loads(shown.stdout) if shown.returncode == 0 else {}


def synthesize(stage: str) -> list[tuple[str, Path, dict[str, Any]]]:
    """(stack name, snapshot path, current template) of every stack of the stage."""
    app, stacks = build(stage, nag=False)
    return [(stack.stack_name, snapshot_path(stack), template_json(app, stack)) for stack in stacks.values()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--update", action="store_true", help="rewrite the snapshots with the current synthesis")
    parser.add_argument(
        "--stage",
        choices=SNAPSHOT_STAGES,
        action="append",
        help="only this stage (repeatable); default: all of " + ", ".join(SNAPSHOT_STAGES),
    )
    parser.add_argument(
        "--base",
        metavar="GIT_REV",
        default=None,
        help="compare with the snapshots committed at this revision (default: the working tree's)",
    )
    parser.add_argument(
        "--acknowledge",
        metavar="STACK/LOGICAL_ID",
        action="append",
        default=[],
        help="accept replacing or removing this retained resource (repeatable)",
    )
    args = parser.parse_args(argv)
    acknowledged = load_acknowledged() | set(args.acknowledge)
    changed, found, current = False, [], []
    for stage in args.stage or SNAPSHOT_STAGES:
        old_stage, new_stage = {}, {}
        for name, path, template in synthesize(stage):
            old_stage[name], new_stage[name] = _snapshot_at(args.base, path), template
            lines, replaced = diff_template(name, old_stage[name], template, acknowledged=frozenset(acknowledged))
            changed |= bool(lines)
            found += replaced
            current.append((path, template))
            if lines and not args.update:
                print("\n".join(lines) + "\n")
        review = deploy_review(old_stage, new_stage)
        if review and not args.update:
            print("\n".join([f"Deploying stage {stage}", *review]) + "\n")
    stop = blocking(found, acknowledged)
    for r in stop:
        print(
            f"error: {r.key} ({r.type}, DeletionPolicy Retain) would be {r.change}: {r.because}. Keep its "
            f"construct id and create-only properties, or acknowledge it with a reason in "
            f"{ACKNOWLEDGEMENTS.name} ({ACKNOWLEDGEMENTS.parent})",
            file=sys.stderr,
        )
    if stop:
        return EXIT_RETAINED_REPLACED
    if args.update:
        for path, template in current:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(template, indent=1, sort_keys=True) + "\n")
            print(f"wrote {path}")
        return 0
    if not changed:
        print("No differences between the snapshots and the current synthesis.")
    return EXIT_CHANGED if changed else 0


if __name__ == "__main__":
    sys.exit(main())
