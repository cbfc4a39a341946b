"""Stateful resources: KMS key, buckets, FSx for Lustre. Termination-protected; construct ids of
these resources are pinned by tests (renaming one would replace -- i.e. lose -- the data)."""

from __future__ import annotations

import functools
from typing import Any

from aws_cdk import CfnOutput, Duration, RemovalPolicy, Stack
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms
from aws_cdk import aws_s3 as s3
from constructs import Construct

from pipeline_contract import ARTIFACTS_BUCKET_OUTPUT, DATA_BUCKET_OUTPUT, INCOMING_PREFIX
from stacks.config import StageConfig
from stacks.constructs.checkov import skip_checkov
from stacks.constructs.fsx_lustre import LustreStorage
from stacks.constructs.secure_bucket import access_log_bucket, secure_bucket
from stacks.network_stack import NetworkStack


class StorageStack(Stack):
    """Public attributes: key, log_bucket, data_bucket, artifacts_bucket, cache_bucket,
    file_system, lustre (the LustreStorage construct with the two associations)."""

    def __init__(
        self, scope: Construct, construct_id: str, *, config: StageConfig, network: NetworkStack, **kwargs: Any
    ) -> None:
        super().__init__(scope, construct_id, termination_protection=True, **kwargs)
        storage = config.storage

        self.key = self._encryption_key(config)
        self.log_bucket = access_log_bucket(self, "LogBucket", expiration_days=storage.access_log_expiration_days)
        common = functools.partial(secure_bucket, self, key=self.key, log_bucket=self.log_bucket,
                                   noncurrent_version_expiration_days=storage.noncurrent_version_expiration_days)
        # EventBridge on the data bucket: the pipeline's trigger listens for `_SUCCESS` markers.
        self.data_bucket = common("DataBucket", event_bridge_enabled=True)
        self.artifacts_bucket = common("ArtifactsBucket")
        self.cache_bucket = common("CacheBucket", extra_lifecycle_rules=[
            s3.LifecycleRule(id="ExpireCacheEntries", expiration=Duration.days(storage.cache_expiration_days))])

        self.lustre = LustreStorage(
            self,
            "Lustre",
            config=storage,
            vpc=network.vpc,
            subnet=network.training_subnet,
            security_group=network.fsx_security_group,
            key=self.key,
            data_bucket=self.data_bucket,
            artifacts_bucket=self.artifacts_bucket,
        )
        self.file_system = self.lustre.file_system

        # What operators and trainium-runs need: where to upload data, where runs land.
        CfnOutput(self, DATA_BUCKET_OUTPUT, value=self.data_bucket.bucket_name,
                  description=f"Upload datasets to s3://<this>/{INCOMING_PREFIX}<dataset>/<version>/ (then "
                              f"{config.pipeline.success_marker})")
        CfnOutput(self, ARTIFACTS_BUCKET_OUTPUT, value=self.artifacts_bucket.bucket_name,
                  description="Runs (s3://<this>/runs/<run id>/) and the published model (models/current.json)")

    def _encryption_key(self, config: StageConfig) -> kms.Key:
        key = kms.Key(
            self,
            "Key",
            description=f"{config.project}-{config.name}: training data, artifacts, compile cache, FSx",
            enable_key_rotation=True,
            removal_policy=RemovalPolicy.RETAIN,
        )
        # FSx data repository associations read/write the SSE-KMS buckets as a per-file-system
        # service-linked role (AWSServiceRoleForFSxS3Access_fs-...), whose managed policy has no
        # KMS rights: allow it here, only via S3 and only from this account. A wildcard on the role
        # name avoids a key -> file system dependency (the file system uses this key).
        # https://docs.aws.amazon.com/fsx/latest/LustreGuide/s3-server-side-encryption-support.html
        key.add_to_resource_policy(
            iam.PolicyStatement(
                sid="FsxDataRepositoryAccessViaS3",
                principals=[iam.AnyPrincipal()],
                actions=["kms:Encrypt", "kms:Decrypt", "kms:ReEncrypt*", "kms:GenerateDataKey*", "kms:DescribeKey"],
                resources=["*"],
                conditions={
                    "StringEquals": {"kms:CallerAccount": self.account, "kms:ViaService": f"s3.{self.region}.amazonaws.com"},
                    "ArnLike": {
                        "aws:PrincipalArn": f"arn:{self.partition}:iam::{self.account}:role/aws-service-role/"
                        "s3.data-source.lustre.fsx.amazonaws.com/AWSServiceRoleForFSxS3Access_*"
                    },
                },
            )
        )
        skip_checkov(key, {"CKV_AWS_33": "The only '*' principal is FsxDataRepositoryAccessViaS3: limited to this "
                                          "account (kms:CallerAccount), to S3 in this region (kms:ViaService) and to "
                                          "the FSx S3-access service-linked roles (aws:PrincipalArn). A role name "
                                          "cannot be a principal pattern, and its exact name holds the file system "
                                          "id, which would make the key depend on the file system it encrypts."})
        return key
