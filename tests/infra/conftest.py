"""Session fixtures: each stage is synthesized once per test session (CDK synth of all stacks
takes ~15 s on 2 cores); every test file reuses the templates.

Fixtures for other test files (the orchestration tests use them too):
    dev_stage / prod_stage      dict[str, Stack] from build_stage (registry image injected; cdk-nag attached)
    dev_config / prod_config    the StageConfig used
    dev_templates / prod_templates  dict[str, assertions.Template], same keys as the stage dict
    template_of(stack)          Template.from_stack for any stack of those apps (cached)
    teams_app_and_stage / teams_templates   the dev stage with teams search and ads (stack name -> template)
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from aws_cdk import Stack
from aws_cdk.assertions import Template

from infra_synth import build, stage_config  # noqa: F401 (sets up sys.path and jsii env first)

_TEMPLATE_CACHE: dict[int, Template] = {}


def _template(stack: Stack) -> Template:
    key = id(stack)
    if key not in _TEMPLATE_CACHE:
        _TEMPLATE_CACHE[key] = Template.from_stack(stack)
    return _TEMPLATE_CACHE[key]


@pytest.fixture(scope="session")
def template_of() -> Callable[[Stack], Template]:
    return _template


@pytest.fixture(scope="session")
def dev_config():
    return stage_config("dev")


@pytest.fixture(scope="session")
def prod_config():
    return stage_config("prod")


@pytest.fixture(scope="session")
def dev_app_and_stage():
    return build("dev")


@pytest.fixture(scope="session")
def prod_app_and_stage():
    return build("prod")


@pytest.fixture(scope="session")
def dev_stage(dev_app_and_stage) -> dict[str, Stack]:
    return dev_app_and_stage[1]


@pytest.fixture(scope="session")
def prod_stage(prod_app_and_stage) -> dict[str, Stack]:
    return prod_app_and_stage[1]


@pytest.fixture(scope="session")
def dev_templates(dev_stage) -> dict[str, Template]:
    return {name: _template(stack) for name, stack in dev_stage.items()}


@pytest.fixture(scope="session")
def prod_templates(prod_stage) -> dict[str, Template]:
    return {name: _template(stack) for name, stack in prod_stage.items()}


@pytest.fixture(scope="session")
def teams_app_and_stage():
    """The dev stage with two teams, search and ads (infra_synth.teams_stage_config)."""
    from infra_synth import teams_stage_config

    return build("dev", config=teams_stage_config())


@pytest.fixture(scope="session")
def teams_templates(teams_app_and_stage) -> dict[str, dict]:
    """Stack name -> synthesized template of the teams stage."""
    from infra_synth import template_json

    app, stacks = teams_app_and_stage
    return {stack.stack_name: template_json(app, stack) for stack in stacks.values()}
