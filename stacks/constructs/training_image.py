"""The training image: training_image/Dockerfile built by `cdk deploy` as a DockerImageAsset.

The build context is the repository root (the image installs the repo's pyproject.toml,
pipeline_contract/ and pipeline_steps/), filtered to an allow-list so the asset hash depends only on what the image
contains: cdk.out, .venv, node_modules, tests, caches and everything else are excluded.
"""

from __future__ import annotations

from pathlib import Path

from aws_cdk import IgnoreMode
from aws_cdk import aws_ecr_assets as ecr_assets
from constructs import Construct

from pipeline_contract import GIT_COMMIT_ENV

REPO_ROOT = Path(__file__).resolve().parents[2]

# Docker-style patterns: exclude everything, then re-include what the Dockerfile COPYs.
BUILD_CONTEXT_EXCLUDE: tuple[str, ...] = (
    "*",
    "!pyproject.toml",
    "!README.md",
    "!pipeline_contract",
    "!pipeline_contract/**",
    "!pipeline_steps",
    "!pipeline_steps/**",
    "!training_image",
    "!training_image/**",
    "**/__pycache__",
    "**/*.pyc",
)

def training_image_asset(scope: Construct, construct_id: str, *, git_commit: str) -> ecr_assets.DockerImageAsset:
    """The image asset; `git_commit` becomes the build arg GIT_COMMIT (the image's env), so the
    asset hash, and with it the deployed image, follows the commit."""
    return ecr_assets.DockerImageAsset(
        scope,
        construct_id,
        directory=str(REPO_ROOT),
        file="training_image/Dockerfile",
        platform=ecr_assets.Platform.LINUX_AMD64,
        exclude=list(BUILD_CONTEXT_EXCLUDE),
        ignore_mode=IgnoreMode.DOCKER,
        display_name="training-image",
        build_args={GIT_COMMIT_ENV: git_commit},
    )
