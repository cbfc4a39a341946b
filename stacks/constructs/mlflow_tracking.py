"""A SageMaker managed MLflow tracking server for the pipeline's experiment tracking. The steps log
to it through `MLFLOW_TRACKING_URI=<tracking server ARN>` (pipeline_steps/tracking.py; the image's
`sagemaker-mlflow` plugin signs requests with the job role); artifacts go to
`s3://<artifacts bucket>/<artifact_prefix>`.
"""

from __future__ import annotations

from aws_cdk import aws_iam as iam
from aws_cdk import aws_s3 as s3
from aws_cdk import aws_sagemaker as sagemaker
from cdk_nag import NagPackSuppression, NagSuppressions
from constructs import Construct

from stacks.constructs.secure_bucket import acknowledge_bucket_grants


class MlflowTracking(Construct):
    """Public attributes: `tracking_server_arn` (the MLFLOW_TRACKING_URI value), `role`, `server`."""

    def __init__(self, scope: Construct, construct_id: str, *, name: str, artifacts_bucket: s3.IBucket,
                 artifact_prefix: str = "mlflow", size: str = "Small") -> None:
        super().__init__(scope, construct_id)
        if size not in ("Small", "Medium", "Large"):
            raise ValueError(f"MlflowTracking size={size!r}: one of Small, Medium, Large.")
        prefix = artifact_prefix.strip("/")
        self._artifacts, self._prefix = artifacts_bucket, prefix
        # The server's own role reads/writes the artifact prefix; a client needs sagemaker-mlflow:*
        # on the server ARN (grant_access)
        # (https://docs.aws.amazon.com/sagemaker/latest/dg/mlflow-create-tracking-server-iam.html).
        self.role = iam.Role(self, "ServerRole", assumed_by=iam.ServicePrincipal("sagemaker.amazonaws.com"),
                             description="SageMaker MLflow tracking server: artifact store access")
        artifacts_bucket.grant_read_write(self.role, f"{prefix}/*")
        acknowledge_bucket_grants(
            self.role,
            reason="artifacts_bucket.grant_read_write(role, 'mlflow/*'): the tracking server writes run "
            "artifacts under arbitrary keys below the mlflow/ prefix only; the action groups "
            "(s3:GetObject*, s3:List*, kms:GenerateDataKey*, ...) are CDK's minimal grant sets.",
            objects_regex=r"/^Resource::(<|.*ExportsOutputFnGetAtt)ArtifactsBucket[0-9A-F]+"
            r"(\.Arn>|Arn[0-9A-F]+)\/mlflow\/\*$/g",
        )
        self.server = sagemaker.CfnMlflowTrackingServer(
            self, "Server",
            tracking_server_name=name,
            artifact_store_uri=f"s3://{artifacts_bucket.bucket_name}/{prefix}",
            role_arn=self.role.role_arn,
            tracking_server_size=size,
            automatic_model_registration=False,
        )
        self.server.node.add_dependency(self.role)
        self.tracking_server_arn = self.server.attr_tracking_server_arn

    def grant_access(self, grantee: iam.IRole) -> iam.Grant:
        """Let a job role log runs: the sagemaker-mlflow data-plane actions on this server only, and
        the artifact prefix, which the MLflow client writes run artifacts to itself."""
        grant = iam.Grant.add_to_principal(grantee=grantee, actions=["sagemaker-mlflow:*"],
                                           resource_arns=[self.tracking_server_arn])
        self._artifacts.grant_read_write(grantee, f"{self._prefix}/*")
        NagSuppressions.add_resource_suppressions(
            grantee,
            [
                NagPackSuppression(
                    id="AwsSolutions-IAM5",
                    reason="MlflowTracking.grant_access: 'sagemaker-mlflow:*' is the data-plane action set the "
                    "MLflow client needs (create/search experiments and runs, log batches and artifacts), per the "
                    "SageMaker MLflow IAM guide, and the resource is this stage's one tracking server ARN.",
                    applies_to=["Action::sagemaker-mlflow:*"],
                )
            ],
            apply_to_children=True,
        )
        return grant
