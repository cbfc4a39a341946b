#!/usr/bin/env python3
"""CDK app: the only place that reads the outside world (context, environment).

    npx cdk synth -c stage=prod -c training_az_id=<zone id>                          # the cdk CLI
    CDK_CONTEXT_JSON='{"stage":"prod","training_az_id":"<zone id>"}' python app.py     # plain python

Context keys: stage (default "dev", stacks/config.py STAGES), training_az_id (required), region,
account, git_commit, nag=false; docs/infrastructure.md ("Synthesize, test, choose the stage").
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import aws_cdk as cdk
from cdk_nag import AwsSolutionsChecks

from stacks.config import get_stage
from stacks.stages import build_stage

USAGE = (
    "app.py takes no arguments; pass context the way the cdk CLI does:\n"
    "    CDK_CONTEXT_JSON='{\"stage\":\"prod\",\"training_az_id\":\"<zone id>\"}' python app.py\n"
    "    (or: npx cdk synth -c stage=prod -c training_az_id=<zone id>)"
)


def cdk_json_context() -> dict[str, object]:
    """cdk.json's context (feature flags, default stage), so `python app.py` synthesizes exactly
    what `cdk synth` does; CDK_CONTEXT_JSON (the CLI's -c values) still overrides these defaults."""
    return dict(json.loads((Path(__file__).parent / "cdk.json").read_text())["context"])


def git_head() -> str | None:
    """The checkout's commit, or None outside a git work tree (a source tarball, no git)."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=Path(__file__).parent,
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # The cdk CLI hands its context (cdk.json + every `-c key=value`) to the app in CDK_CONTEXT_JSON;
    # plain python would silently ignore `python app.py -c stage=prod`, so arguments are refused.
    if argv:
        print(f"app.py: unexpected arguments {argv}.\n{USAGE}", file=sys.stderr)
        return 2
    # cdk.App applies CDK_CONTEXT_JSON on top of the context given here. The cdk CLI sets
    # CDK_OUTDIR; plain `python app.py` writes to ./cdk.out (not a temp dir).
    app = cdk.App(context=cdk_json_context(), outdir=os.environ.get("CDK_OUTDIR") or "cdk.out")
    try:
        stage = get_stage(str(app.node.try_get_context("stage") or "dev"))
        cfg = stage.with_env(
            # CDK_DEFAULT_*: what the cdk CLI sets from your credentials; else the stage's defaults
            # (region pinned, account-agnostic).
            account=app.node.try_get_context("account") or os.environ.get("CDK_DEFAULT_ACCOUNT"),
            region=app.node.try_get_context("region") or os.environ.get("CDK_DEFAULT_REGION"),
            # The training image's GIT_COMMIT build arg: a given commit always synthesizes the same
            # image asset ("unknown" outside a git work tree).
            git_commit=str(app.node.try_get_context("git_commit") or git_head() or "unknown"),
            training_az_id=app.node.try_get_context("training_az_id") or None,
        )
        build_stage(app, cfg)
    except ValueError as exc:  # config validation: the message carries the fix
        print(f"app.py: {exc}", file=sys.stderr)
        return 1
    if str(app.node.try_get_context("nag") or "true").lower() != "false":
        cdk.Aspects.of(app).add(AwsSolutionsChecks(verbose=True))
    assembly = app.synth()
    # The cdk CLI prints annotations; plain python would not, so warnings (e.g. an unpinned AMI)
    # are printed here too.
    for artifact in assembly.stacks:
        for message in artifact.messages:
            level = str(message.level.value).lower()
            if level in ("warning", "error"):
                print(f"[{level}] {artifact.stack_name}: {message.entry.data}", file=sys.stderr)
    print(f"app.py: synthesized stage {cfg.name!r} ({cfg.region}) into {app.outdir}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
