"""cfn-lint (zero errors) and cdk-nag AwsSolutions (zero unacknowledged findings) on every
synthesized template of both stages."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from aws_cdk.assertions import Annotations, Match

STAGES = ("dev_app_and_stage", "prod_app_and_stage")


@pytest.mark.parametrize("stage_fixture", STAGES)
def test_cdk_nag_has_no_unacknowledged_findings(request, stage_fixture, template_of):
    _, stacks = request.getfixturevalue(stage_fixture)
    for name, stack in stacks.items():
        template_of(stack)  # synthesizes (runs the nag aspect) once
        annotations = Annotations.from_stack(stack)
        errors = annotations.find_error("*", Match.string_like_regexp(r"AwsSolutions-.*"))
        warnings = annotations.find_warning("*", Match.string_like_regexp(r"AwsSolutions-.*"))
        findings = [f"{m.id}: {str(m.entry.data)[:160]}" for m in [*errors, *warnings]]
        assert not findings, f"{name}:\n" + "\n".join(findings)


@pytest.mark.parametrize("stage_fixture", STAGES)
def test_cfn_lint_has_no_errors(request, stage_fixture, template_of, tmp_path: Path):
    _, stacks = request.getfixturevalue(stage_fixture)
    paths = []
    for name, stack in stacks.items():
        path = tmp_path / f"{stack.stack_name}.template.json"
        path.write_text(json.dumps(template_of(stack).to_json(), indent=1))
        paths.append(str(path))
    # Errors only (-i W I would hide warnings from the count: cfn-lint exits 2 on errors, 4 on warnings).
    result = subprocess.run(
        [sys.executable, "-m", "cfnlint", "--format", "parseable", *paths],
        capture_output=True, text=True, check=False,
    )
    errors = [line for line in result.stdout.splitlines() if ":E" in line or line.split(":")[-2:-1] == ["E"]]
    assert result.returncode & 2 == 0 and not errors, result.stdout + result.stderr
