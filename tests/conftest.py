"""Shared by every test directory. Test helpers are modules of the `tests` package (tests.infra,
tests.e2e, tests.steps) and of `scripts` (stage_synth: the stage as the tests and the snapshot diff
synthesize it), imported by their package names.

The suite runs on parallel workers (`make test`: pytest-xdist, `--dist loadgroup`). A fixture
wider than a test is built once per worker that needs it, so tests that share an expensive one are
kept on one worker: the group is the fixture's name for the session fixtures below, the module for
a module-scoped fixture (each e2e module's moto world and pipeline runs among them). Every other
test goes to whichever worker is free. Without xdist (a focused `pytest tests/...`) the groups do
nothing."""

from __future__ import annotations

import os

import pytest

from pipeline_steps.worker_pool import available_cpus
from tests.suite_environment import SUITE_ENVIRONMENT

# jsii's Node.js end-of-life banner would drown the test output (Node 20 on CI boxes); set before
# any test module imports aws_cdk (which starts Node).
os.environ.setdefault("JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION", "20")
os.environ.setdefault("JSII_SILENCE_WARNING_DEPRECATED_NODE_VERSION", "1")
for _name, _value in SUITE_ENVIRONMENT.items():  # before any test module imports torch
    os.environ.setdefault(_name, _value)

# Session fixtures that take from half a minute (a synthesized stage with its cdk-nag checks) to
# several minutes (run-local on each backend), in the order a test that uses several is grouped by.
SHARED_SESSION_FIXTURES = ("tiny_run_local", "dev_app_and_stage", "prod_app_and_stage", "teams_app_and_stage")


@pytest.hookimpl(optionalhook=True)  # an xdist hook: `-p no:xdist` must not refuse it
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`-n auto`: one worker more than the CPUs this process may use (affinity and a container's
    CPU quota). A worker that waits (a moto execution's retry interval, a subprocess starting, a
    polling loop) leaves its core to the extra one."""
    return available_cpus() + 1


def share_group(item: pytest.Item) -> str | None:
    """The xdist group of `item`: its costliest shared fixture's, or None (any worker)."""
    fixtures = getattr(item, "_fixtureinfo", None)
    if fixtures is None:
        return None
    used = set(item.fixturenames)
    for name in SHARED_SESSION_FIXTURES:
        if name in used:
            return name
    if any(d.scope == "module" for defs in fixtures.name2fixturedefs.values() for d in defs):
        return item.nodeid.split("::")[0]
    return None


# First: xdist's own hook (on each worker) turns the markers into the scheduling groups, and a hook
# of a plugin registered after this file runs before it unless this one asks to go first.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.pluginmanager.hasplugin("xdist"):  # `-p no:xdist`: no groups, and no unknown marker
        return
    for item in items:
        group = share_group(item)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
