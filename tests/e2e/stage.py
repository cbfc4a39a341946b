"""The dev stage as synthesized, with its CloudFormation references resolvable to local stand-ins.

`synthesize()` builds the dev stage the way tests/infra does (tests/infra/infra_synth.py: the stage
config with the test account, a registry image instead of the image asset; the training preset
tiny) and returns every stack's template. `Stage.resolve(stack, token)` turns Ref / Fn::GetAtt / Fn::ImportValue /
Fn::Join / Fn::Sub into plain strings from the values bound with `bind`, following exports across
stacks as CloudFormation does; a reference nobody bound raises KeyError (never a silent guess).
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

INFRA_TESTS = Path(__file__).resolve().parents[1] / "infra"
if str(INFRA_TESTS) not in sys.path:
    sys.path.insert(0, str(INFRA_TESTS))

import aws_cdk as cdk  # noqa: E402
from infra_synth import (  # noqa: E402
    TEST_DIAGNOSIS_ASSET_HASH, TEST_IMAGE, cdk_json_context, stage_config, template_json,
)

from stacks.config import StageConfig  # noqa: E402
from stacks.stages import build_stage  # noqa: E402

STAGE = "dev"
PSEUDO = {"AWS::Partition": "aws", "AWS::URLSuffix": "amazonaws.com"}


@dataclass
class Stage:
    """Templates by role ("network", "storage", "compute", "pipeline") and the CDK stacks."""

    stacks: dict[str, Any]
    templates: dict[str, dict]
    values: dict[tuple[str, str], str] = field(default_factory=dict)

    @property
    def account(self) -> str:
        return self.stacks["pipeline"].account

    @property
    def region(self) -> str:
        return self.stacks["pipeline"].region

    def logical_id(self, construct) -> str:
        from aws_cdk import Stack

        child = getattr(construct.node, "default_child", None) or construct
        return Stack.of(construct).get_logical_id(child)

    def bind(self, role: str, construct, ref: str, **attributes: str) -> None:
        """What `Ref` (and `Fn::GetAtt` of each attribute) of the construct resolves to."""
        lid = self.logical_id(construct)
        self.values[(role, lid)] = ref
        for name, value in attributes.items():
            self.values[(role, f"{lid}.{name}")] = value

    def resources(self, role: str, resource_type: str) -> dict[str, dict]:
        return {lid: res for lid, res in self.templates[role]["Resources"].items() if res["Type"] == resource_type}

    def _export(self, name: str) -> tuple[str, Any]:
        for role, template in self.templates.items():
            for output in template.get("Outputs", {}).values():
                if output.get("Export", {}).get("Name") == name:
                    return role, output["Value"]
        raise KeyError(f"no stack exports {name!r}")

    def resolve(self, role: str, token: Any) -> Any:
        """`token` with every intrinsic function replaced; dicts and lists are resolved recursively."""
        if isinstance(token, list):
            return [self.resolve(role, item) for item in token]
        if not isinstance(token, dict):
            return token
        if len(token) == 1:
            (fn, arg), = token.items()
            if fn == "Ref":
                if arg in PSEUDO or arg in ("AWS::Region", "AWS::AccountId"):
                    return {"AWS::Region": self.region, "AWS::AccountId": self.account}.get(arg) or PSEUDO[arg]
                return self.values[(role, arg)]
            if fn == "Fn::GetAtt":
                lid, attribute = arg if isinstance(arg, list) else arg.split(".", 1)
                return self.values[(role, f"{lid}.{attribute}")]
            if fn == "Fn::ImportValue":
                exporter, value = self._export(self.resolve(role, arg))
                return self.resolve(exporter, value)
            if fn == "Fn::Join":
                separator, parts = arg
                return separator.join(str(self.resolve(role, part)) for part in parts)
            if fn == "Fn::Sub" and isinstance(arg, str):
                return re.sub(r"\$\{([^}]+)\}", lambda m: str(self.resolve(role, {"Ref": m.group(1)})), arg)
        return {key: self.resolve(role, value) for key, value in token.items()}

    def state_machine_definition(self, construct) -> dict:
        lid = self.logical_id(construct)
        res = self.templates["pipeline"]["Resources"][lid]
        return json.loads(self.resolve("pipeline", res["Properties"]["DefinitionString"]))


def synthesize(preset: str = "tiny", config: StageConfig | None = None) -> Stage:
    """The dev stage's stacks and templates (one synthesis: ~30 s of CDK work on 2 cores), as
    tests/infra synthesizes it, with the training preset set to `preset` (the stage's TrainingConfig renders it into the
    Prepare, Compile and Train commands); `config` replaces the dev stage's (e.g. with teams)."""
    cfg = config or stage_config(STAGE)
    cfg = replace(cfg, training=replace(cfg.training, preset=preset))
    app = cdk.App(context=cdk_json_context())
    stacks = build_stage(app, cfg, image_uri=TEST_IMAGE, diagnosis_asset_hash=TEST_DIAGNOSIS_ASSET_HASH)
    return Stage(stacks=stacks, templates={role: template_json(app, stack) for role, stack in stacks.items()})
