"""A deploy uses the versions that were tested: the CDK CLI pinned in package-lock.json (installed
with `npm ci`), the Python libraries pinned in deploy-constraints.txt; no doc or script floats."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from importlib import metadata

from scripts.stage_synth import REPO_ROOT

_spec = importlib.util.spec_from_file_location("lock_deploy", REPO_ROOT / "scripts" / "lock_deploy.py")
lock_deploy = sys.modules["lock_deploy"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lock_deploy)

DOCUMENTED = [REPO_ROOT / "README.md", REPO_ROOT / "Makefile", REPO_ROOT / "app.py",
              *REPO_ROOT.glob("docs/*.md"), *REPO_ROOT.glob("scripts/*")]


def test_the_cdk_cli_is_pinned_exactly_and_locked() -> None:
    wanted = json.loads((REPO_ROOT / "package.json").read_text())["devDependencies"]["aws-cdk"]
    assert re.fullmatch(r"\d+\.\d+\.\d+", wanted), f"aws-cdk {wanted!r} is a range; pin one version"
    lock = json.loads((REPO_ROOT / "package-lock.json").read_text())
    assert lock["packages"]["node_modules/aws-cdk"]["version"] == wanted
    assert lock["packages"]["node_modules/aws-cdk"]["integrity"].startswith("sha512-")


def test_no_doc_or_script_runs_a_floating_cdk_cli() -> None:
    floating = [f"{path.relative_to(REPO_ROOT)}: {line.strip()}" for path in DOCUMENTED if path.is_file()
                for line in path.read_text().splitlines() if re.search(r"aws-cdk@(?!<version>)|npx (-y |--yes )?aws-cdk", line)]
    assert floating == []


def test_the_makefile_installs_the_lock_files() -> None:
    makefile = (REPO_ROOT / "Makefile").read_text()
    assert "npm ci" in makefile
    assert "-c deploy-constraints.txt '.[infra,ops]'" in makefile


def test_deploy_constraints_pin_every_infra_and_ops_dependency_at_the_tested_version() -> None:
    pins = lock_deploy.pinned((REPO_ROOT / "deploy-constraints.txt").read_text())
    needed = lock_deploy.closure(lock_deploy.roots())
    assert needed - set(pins) == set(), "unpinned: rerun scripts/lock_deploy.py (`make lock`)"
    assert {"aws-cdk-lib", "constructs", "cdk-nag", "boto3", "jsii"} <= set(pins)
    drift = {name: (pins[name], metadata.version(name)) for name in needed if pins[name] != metadata.version(name)}
    assert drift == {}, "the tested venv differs from deploy-constraints.txt (pinned, tested): run `make lock`"
