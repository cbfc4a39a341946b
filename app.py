#!/usr/bin/env python3
"""CDK app: the only place that reads the outside world (context, environment).

    npx cdk synth -c stage=prod          # or: python app.py (synthesizes into cdk.out)
    -c stage=NAME      dev (default, cdk.json) or prod: stacks/config.py STAGES
    -c region=R / -c account=A, else CDK_DEFAULT_REGION / CDK_DEFAULT_ACCOUNT (set by the cdk CLI
    from your credentials), else the stage's defaults (region pinned, account-agnostic).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import aws_cdk as cdk
from cdk_nag import AwsSolutionsChecks

from stacks.config import get_stage
from stacks.stages import build_stage


def cdk_json_context() -> dict[str, object]:
    """cdk.json's context (feature flags, default stage), so `python app.py` synthesizes exactly
    what `cdk synth` does; context from the CLI (-c) still overrides these defaults."""
    return dict(json.loads((Path(__file__).parent / "cdk.json").read_text())["context"])


def main() -> None:
    # The cdk CLI sets CDK_OUTDIR; plain `python app.py` writes to ./cdk.out (not a temp dir).
    app = cdk.App(context=cdk_json_context(), outdir=os.environ.get("CDK_OUTDIR") or "cdk.out")
    stage = get_stage(str(app.node.try_get_context("stage") or "dev"))
    cfg = stage.with_env(
        account=app.node.try_get_context("account") or os.environ.get("CDK_DEFAULT_ACCOUNT"),
        region=app.node.try_get_context("region") or os.environ.get("CDK_DEFAULT_REGION"),
    )
    build_stage(app, cfg)
    if str(app.node.try_get_context("nag") or "true").lower() != "false":
        cdk.Aspects.of(app).add(AwsSolutionsChecks(verbose=True))
    app.synth()


if __name__ == "__main__":
    main()
