"""FSx for Lustre scratch-fast shared storage for every node, linked to S3.

PERSISTENT_2 (survives server failures; the only deployment type with data repository
associations per path), Lustre 2.15 (the AL2023 lustre-client), LZ4 compression, in the training
subnet/AZ. Two data repository associations (the steps' paths):
  /fsx/data <-> s3://<data bucket>/            auto import (new uploads appear on FSx)
  /fsx/runs <-> s3://<artifacts bucket>/runs/  auto import + auto export (checkpoints, metrics
                                               and embeddings written on FSx land in S3)
"""

from __future__ import annotations

from aws_cdk import Duration, RemovalPolicy
from aws_cdk import aws_ec2 as ec2
from aws_cdk import aws_fsx as fsx
from aws_cdk import aws_kms as kms
from aws_cdk import aws_s3 as s3
from constructs import Construct

from pipeline_contract import FSX_DATA, FSX_MOUNT_POINT, FSX_RUNS, RUNS_PREFIX
from stacks.config import StorageConfig

_ALL_EVENTS = ["NEW", "CHANGED", "DELETED"]


class LustreStorage(Construct):
    """Public attributes: file_system (fsx.LustreFileSystem), data_association and
    runs_association (fsx.CfnDataRepositoryAssociation), mount_name (token)."""

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        config: StorageConfig,
        vpc: ec2.IVpc,
        subnet: ec2.ISubnet,
        security_group: ec2.ISecurityGroup,
        key: kms.IKey,
        data_bucket: s3.IBucket,
        artifacts_bucket: s3.IBucket,
    ) -> None:
        super().__init__(scope, construct_id)
        backups = config.fsx_automatic_backup_retention_days
        self.file_system = fsx.LustreFileSystem(
            self,
            "FileSystem",
            vpc=vpc,
            vpc_subnet=subnet,
            security_group=security_group,
            storage_capacity_gib=config.fsx_storage_capacity_gib,
            file_system_type_version=fsx.FileSystemTypeVersion.V_2_15,
            kms_key=key,
            removal_policy=RemovalPolicy.RETAIN,
            lustre_configuration=fsx.LustreConfiguration(
                deployment_type=fsx.LustreDeploymentType.PERSISTENT_2,
                per_unit_storage_throughput=config.fsx_throughput_mbps_per_tib,
                data_compression_type=fsx.LustreDataCompressionType.LZ4,
                automatic_backup_retention=Duration.days(backups) if backups else None,
                copy_tags_to_backups=True if backups else None,
            ),
        )
        self.mount_name = self.file_system.mount_name

        self.data_association = fsx.CfnDataRepositoryAssociation(
            self,
            "DataAssociation",
            file_system_id=self.file_system.file_system_id,
            file_system_path=FSX_DATA.removeprefix(FSX_MOUNT_POINT),  # a path inside the file system
            data_repository_path=f"s3://{data_bucket.bucket_name}/",
            # Existing objects' metadata is listed at creation; contents load lazily on first read.
            batch_import_meta_data_on_create=True,
            s3=fsx.CfnDataRepositoryAssociation.S3Property(
                auto_import_policy=fsx.CfnDataRepositoryAssociation.AutoImportPolicyProperty(events=_ALL_EVENTS),
            ),
        )
        self.runs_association = fsx.CfnDataRepositoryAssociation(
            self,
            "RunsAssociation",
            file_system_id=self.file_system.file_system_id,
            file_system_path=FSX_RUNS.removeprefix(FSX_MOUNT_POINT),
            data_repository_path=f"s3://{artifacts_bucket.bucket_name}/{RUNS_PREFIX}",
            batch_import_meta_data_on_create=True,
            s3=fsx.CfnDataRepositoryAssociation.S3Property(
                auto_import_policy=fsx.CfnDataRepositoryAssociation.AutoImportPolicyProperty(events=_ALL_EVENTS),
                auto_export_policy=fsx.CfnDataRepositoryAssociation.AutoExportPolicyProperty(events=_ALL_EVENTS),
            ),
        )
