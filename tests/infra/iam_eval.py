"""A small IAM policy evaluator for the synthesized templates: is this request, made by this role,
allowed? It covers what the templates use, and refuses anything else rather than guess.

Evaluation (https://docs.aws.amazon.com/IAM/latest/UserGuide/reference_policies_evaluation-logic.html),
within one account: an explicit Deny in any applicable policy wins; else an Allow in the role's
identity policies (or, for a resource policy, one naming the role) allows; else the request is
implicitly denied. Statements: Effect, Action/NotAction, Resource/NotResource, Principal (resource
policies and trusts), Condition. Action and Resource patterns use `*` and `?`
(https://docs.aws.amazon.com/IAM/latest/UserGuide/reference_policies_elements_resource.html);
actions match case-insensitively. Condition operators: StringEquals, StringLike, ArnLike, ArnEquals,
Bool, Null and the ForAllValues:/ForAnyValue: set forms of the string ones
(https://docs.aws.amazon.com/IAM/latest/UserGuide/reference_policies_elements_condition_operators.html):
operators and keys AND, a key's values OR; a key absent from the request makes a condition false
(ForAllValues: true; Null tests absence).
CloudFormation intrinsics (Ref, Fn::GetAtt, Fn::ImportValue across the stage's stacks, Fn::Join,
Fn::Sub, pseudo parameters) resolve to physical names given per resource type (PHYSICAL).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

# Ref and Fn::GetAtt of each resource type, as CloudFormation returns them, from its logical id.
PHYSICAL: dict[str, dict[str, str]] = {
    "AWS::S3::Bucket": {"Ref": "{lid_lower}", "Arn": "arn:aws:s3:::{lid_lower}"},
    "AWS::KMS::Key": {"Ref": "{lid}", "Arn": "arn:aws:kms:{region}:{account}:key/{lid}"},
    "AWS::Logs::LogGroup": {"Ref": "{lid}", "Arn": "arn:aws:logs:{region}:{account}:log-group:{lid}:*"},
    "AWS::StepFunctions::StateMachine": {"Ref": "arn:aws:states:{region}:{account}:stateMachine:{lid}",
                                         "Name": "{lid}", "Arn": "arn:aws:states:{region}:{account}:stateMachine:{lid}"},
    "AWS::IAM::Role": {"Ref": "{lid}", "Arn": "arn:aws:iam::{account}:role/{lid}"},
    "AWS::Batch::JobQueue": {"Ref": "arn:aws:batch:{region}:{account}:job-queue/{lid}",
                             "JobQueueArn": "arn:aws:batch:{region}:{account}:job-queue/{lid}"},
    "AWS::SNS::Topic": {"Ref": "arn:aws:sns:{region}:{account}:{lid}", "TopicArn": "arn:aws:sns:{region}:{account}:{lid}"},
    "AWS::Lambda::Function": {"Ref": "{lid}", "Arn": "arn:aws:lambda:{region}:{account}:function:{lid}"},
    "AWS::CloudWatch::Alarm": {"Arn": "arn:aws:cloudwatch:{region}:{account}:alarm:{lid}"},
    "AWS::Events::Rule": {"Arn": "arn:aws:events:{region}:{account}:rule/{lid}"},
}
_STRING_OPERATORS = {"StringEquals": False, "StringLike": True, "ArnEquals": False, "ArnLike": True}


@dataclass
class Stage:
    """The stage's templates by stack name, with intrinsics resolvable across them."""

    templates: Mapping[str, dict]
    account: str
    region: str
    _exports: dict[str, tuple[str, Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for stack, template in self.templates.items():
            for output in template.get("Outputs", {}).values():
                if "Export" in output:
                    self._exports[output["Export"]["Name"]] = (stack, output["Value"])

    def physical(self, stack: str, logical_id: str, attribute: str = "Ref") -> str:
        kind = self.templates[stack]["Resources"][logical_id]["Type"]
        pattern = PHYSICAL[kind][attribute]  # KeyError: give the evaluator that type or attribute
        return pattern.format(lid=logical_id, lid_lower=logical_id.lower(), region=self.region, account=self.account)

    def resolve(self, stack: str, token: Any) -> Any:
        if isinstance(token, list):
            return [self.resolve(stack, item) for item in token]
        if not isinstance(token, dict):
            return token
        if len(token) != 1 or not next(iter(token)).startswith(("Ref", "Fn::")):
            return {key: self.resolve(stack, value) for key, value in token.items()}
        (fn, arg), = token.items()
        pseudo = {"AWS::AccountId": self.account, "AWS::Region": self.region, "AWS::Partition": "aws",
                  "AWS::URLSuffix": "amazonaws.com", "AWS::StackName": stack}
        if fn == "Ref":
            return pseudo[arg] if arg in pseudo else self.physical(stack, arg)
        if fn == "Fn::GetAtt":
            logical_id, attribute = arg if isinstance(arg, list) else arg.split(".", 1)
            return self.physical(stack, logical_id, attribute)
        if fn == "Fn::ImportValue":
            exporter, value = self._exports[self.resolve(stack, arg)]
            return self.resolve(exporter, value)
        if fn == "Fn::Join":
            separator, parts = arg
            return separator.join(str(self.resolve(stack, part)) for part in parts)
        if fn == "Fn::Sub" and isinstance(arg, str):
            return re.sub(r"\$\{([^}]+)\}", lambda m: str(self.resolve(stack, {"Ref": m.group(1)})), arg)
        raise KeyError(f"iam_eval: unsupported intrinsic {fn}")

    def logical_id(self, stack: str, prefix: str, kind: str) -> str:
        """The one resource of `kind` whose logical id starts with `prefix`."""
        (found,) = [lid for lid, r in self.templates[stack]["Resources"].items()
                    if r["Type"] == kind and lid.startswith(prefix)]
        return found

    def identity_statements(self, stack: str, role: str) -> list[dict]:
        """Every statement of the policies attached to the role (inline AWS::IAM::Policy resources
        and the role's own Policies), resolved."""
        resources = self.templates[stack]["Resources"]
        documents = [p["PolicyDocument"] for p in resources[role]["Properties"].get("Policies", [])]
        documents += [r["Properties"]["PolicyDocument"] for r in resources.values()
                      if r["Type"] == "AWS::IAM::Policy" and {"Ref": role} in r["Properties"].get("Roles", [])]
        assert not resources[role]["Properties"].get("ManagedPolicyArns"), "managed policies are not evaluated"
        return [self.resolve(stack, s) for document in documents for s in document["Statement"]]

    def trust_statements(self, stack: str, role: str) -> list[dict]:
        return self.resolve(stack, self.templates[stack]["Resources"][role]["Properties"]["AssumeRolePolicyDocument"]
                            ["Statement"])

    def bucket_policy_statements(self, bucket_arn: str) -> list[dict]:
        """The resource policy of the bucket with that ARN (its TLS-only Deny, for one)."""
        out = []
        for stack, template in self.templates.items():
            for r in template["Resources"].values():
                if r["Type"] == "AWS::S3::BucketPolicy" and \
                        f"arn:aws:s3:::{self.resolve(stack, r['Properties']['Bucket'])}" == bucket_arn:
                    out += self.resolve(stack, r["Properties"]["PolicyDocument"]["Statement"])
        return out


@dataclass(frozen=True)
class Request:
    action: str
    resource: str
    context: Mapping[str, Any] = field(default_factory=dict)

    def __str__(self) -> str:
        keys = ", ".join(f"{k}={v}" for k, v in self.context.items() if k != "aws:SecureTransport")
        return f"{self.action} {self.resource}" + (f" [{keys}]" if keys else "")


def _as_list(value: Any) -> list:
    return value if isinstance(value, list) else [value]


def _matches(pattern: str, value: str, *, case: bool = True) -> bool:
    regex = "".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in pattern)
    return re.fullmatch(regex, value, 0 if case else re.IGNORECASE) is not None


def _condition(operator: str, key: str, expected: list, context: Mapping[str, Any]) -> bool:
    if operator == "Null":
        return (key not in context) == (str(expected[0]).lower() == "true")
    qualifier, _, base = operator.rpartition(":")
    if base == "Bool":
        return key in context and str(context[key]).lower() in {str(e).lower() for e in expected}
    if base not in _STRING_OPERATORS or qualifier not in ("", "ForAllValues", "ForAnyValue"):
        raise KeyError(f"iam_eval: unsupported condition operator {operator}")
    wildcard = _STRING_OPERATORS[base]
    one = (lambda v: any(_matches(e, v) for e in expected)) if wildcard else (lambda v: v in expected)
    if key not in context:
        return qualifier == "ForAllValues"
    values = _as_list(context[key])
    if qualifier == "ForAllValues":
        return all(one(v) for v in values)
    if qualifier == "ForAnyValue":
        return any(one(v) for v in values)
    return one(values[0])


def statement_applies(statement: Mapping[str, Any], request: Request) -> bool:
    if "Action" in statement:
        action_ok = any(_matches(a, request.action, case=False) for a in _as_list(statement["Action"]))
    else:
        action_ok = not any(_matches(a, request.action, case=False) for a in _as_list(statement["NotAction"]))
    if "Resource" in statement:
        resource_ok = any(_matches(r, request.resource) for r in _as_list(statement["Resource"]))
    else:
        resource_ok = not any(_matches(r, request.resource) for r in _as_list(statement.get("NotResource", [])))
    return action_ok and resource_ok and all(
        _condition(operator, key, _as_list(expected), request.context)
        for operator, pairs in statement.get("Condition", {}).items() for key, expected in pairs.items())


def _names(statement: Mapping[str, Any], principal_arn: str) -> bool:
    principal = statement.get("Principal")
    if principal == "*":
        return True
    account = principal_arn.split(":")[4] if principal_arn.count(":") >= 5 else None
    # An account's root ARN as principal delegates to the account's own IAM policies.
    return isinstance(principal, dict) and any(
        p == "*" or _matches(p, principal_arn) or p == f"arn:aws:iam::{account}:root"
        for p in _as_list(principal.get("AWS", [])))


def decide(identity: Iterable[Mapping[str, Any]], request: Request, *, principal_arn: str = "",
           resource_policy: Iterable[Mapping[str, Any]] = ()) -> str:
    """"Allow", "ExplicitDeny" or "ImplicitDeny" for `request` by a principal with these identity
    statements, against the resource's own policy."""
    applicable = [*identity, *(s for s in resource_policy if _names(s, principal_arn))]
    matched = [s for s in applicable if statement_applies(s, request)]
    if any(s["Effect"] == "Deny" for s in matched):
        return "ExplicitDeny"
    return "Allow" if any(s["Effect"] == "Allow" for s in matched) else "ImplicitDeny"


def may_assume(trust: Iterable[Mapping[str, Any]], principal_arn: str) -> bool:
    """Whether the trust policy lets `principal_arn` (a role of the same account) call sts:AssumeRole."""
    request = Request("sts:AssumeRole", "*", {"aws:PrincipalArn": principal_arn})
    return any(s["Effect"] == "Allow" and _names(s, principal_arn) and statement_applies({**s, "Resource": "*"}, request)
               for s in trust)


def describe(statements: Iterable[Mapping[str, Any]]) -> str:
    return json.dumps(list(statements), indent=1)

