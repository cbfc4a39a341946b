"""Storage: KMS, buckets, FSx for Lustre and its data repository associations; logical-id pins."""

from __future__ import annotations

from aws_cdk.assertions import Match

# Renaming a construct id replaces the resource, i.e. loses the data: these ids are pinned.
PINNED_LOGICAL_IDS = {
    "AWS::KMS::Key": {"Key961B73FD"},
    "AWS::S3::Bucket": {"LogBucketCC3B17E8", "DataBucketE3889A50", "ArtifactsBucket2AAC5544", "CacheBucket41D9D0B0"},
    "AWS::FSx::FileSystem": {"LustreFileSystem46590C25"},
}


def test_termination_protection(dev_stage):
    assert dev_stage["storage"].termination_protection is True


def test_logical_ids_pinned(dev_templates):
    t = dev_templates["storage"]
    for resource_type, ids in PINNED_LOGICAL_IDS.items():
        assert set(t.find_resources(resource_type)) == ids, resource_type


def test_stateful_resources_retained(dev_templates):
    t = dev_templates["storage"]
    for resource_type in PINNED_LOGICAL_IDS:
        for logical_id, resource in t.find_resources(resource_type).items():
            assert resource.get("DeletionPolicy") == "Retain", logical_id
            assert resource.get("UpdateReplacePolicy") == "Retain", logical_id


def test_kms_key_rotation(dev_templates):
    dev_templates["storage"].has_resource_properties("AWS::KMS::Key", {"EnableKeyRotation": True})


def test_every_bucket_versioned_encrypted_private_tls_only(dev_templates):
    t = dev_templates["storage"]
    buckets = t.find_resources("AWS::S3::Bucket")
    assert len(buckets) == 4
    for logical_id, bucket in buckets.items():
        props = bucket["Properties"]
        assert props["VersioningConfiguration"] == {"Status": "Enabled"}, logical_id
        assert props["PublicAccessBlockConfiguration"] == {
            "BlockPublicAcls": True, "BlockPublicPolicy": True, "IgnorePublicAcls": True, "RestrictPublicBuckets": True,
        }, logical_id
        sse = props["BucketEncryption"]["ServerSideEncryptionConfiguration"][0]["ServerSideEncryptionByDefault"]
        if logical_id.startswith("LogBucket"):
            assert sse["SSEAlgorithm"] == "AES256"  # S3 log delivery target (see secure_bucket.py)
        else:
            assert sse["SSEAlgorithm"] == "aws:kms", logical_id
            assert sse["KMSMasterKeyID"] == {"Fn::GetAtt": ["Key961B73FD", "Arn"]}, logical_id
            assert props["LoggingConfiguration"]["DestinationBucketName"] == {"Ref": "LogBucketCC3B17E8"}
            rules = {r["Id"]: r for r in props["LifecycleConfiguration"]["Rules"]}
            assert rules["ExpireNoncurrentVersions"]["NoncurrentVersionExpiration"]["NoncurrentDays"] == 30
    policies = t.find_resources("AWS::S3::BucketPolicy")
    assert len(policies) == 4
    for policy in policies.values():
        statements = policy["Properties"]["PolicyDocument"]["Statement"]
        assert any(
            s["Effect"] == "Deny" and s["Condition"] == {"Bool": {"aws:SecureTransport": "false"}} for s in statements
        )


def test_cache_entries_expire_and_data_bucket_sends_events(dev_templates):
    t = dev_templates["storage"]
    t.has_resource_properties(
        "AWS::S3::Bucket",
        {"LifecycleConfiguration": {"Rules": Match.array_with([Match.object_like({"Id": "ExpireCacheEntries", "ExpirationInDays": 60})])}},
    )
    data = t.find_resources("AWS::S3::Bucket")["DataBucketE3889A50"]["Properties"]
    assert data["NotificationConfiguration"] == {"EventBridgeConfiguration": {"EventBridgeEnabled": True}}
    t.resource_count_is("Custom::S3BucketNotifications", 0)
    t.resource_count_is("AWS::Lambda::Function", 0)


def test_fsx_lustre(dev_templates, dev_config):
    t = dev_templates["storage"]
    t.has_resource_properties(
        "AWS::FSx::FileSystem",
        {
            "FileSystemType": "LUSTRE",
            "FileSystemTypeVersion": "2.15",
            "StorageCapacity": dev_config.storage.fsx_storage_capacity_gib,
            "KmsKeyId": {"Ref": "Key961B73FD"},
            "LustreConfiguration": Match.object_like(
                {
                    "DeploymentType": "PERSISTENT_2",
                    "DataCompressionType": "LZ4",
                    "PerUnitStorageThroughput": dev_config.storage.fsx_throughput_mbps_per_tib,
                }
            ),
            "SubnetIds": [{"Fn::ImportValue": Match.string_like_regexp("PrivateSubnet1")}],
        },
    )


def test_data_repository_associations(dev_templates):
    t = dev_templates["storage"]
    t.resource_count_is("AWS::FSx::DataRepositoryAssociation", 2)
    events = ["NEW", "CHANGED", "DELETED"]
    t.has_resource_properties(
        "AWS::FSx::DataRepositoryAssociation",
        {
            "FileSystemPath": "/data",
            "DataRepositoryPath": {"Fn::Join": ["", ["s3://", {"Ref": "DataBucketE3889A50"}, "/"]]},
            "S3": {"AutoImportPolicy": {"Events": events}},
        },
    )
    t.has_resource_properties(
        "AWS::FSx::DataRepositoryAssociation",
        {
            "FileSystemPath": "/runs",
            "DataRepositoryPath": {"Fn::Join": ["", ["s3://", {"Ref": "ArtifactsBucket2AAC5544"}, "/runs/"]]},
            "S3": {"AutoImportPolicy": {"Events": events}, "AutoExportPolicy": {"Events": events}},
        },
    )


def test_fsx_service_role_may_use_key_only_via_s3(dev_templates):
    dev_templates["storage"].has_resource_properties(
        "AWS::KMS::Key",
        {
            "KeyPolicy": {
                "Statement": Match.array_with(
                    [
                        Match.object_like(
                            {
                                "Sid": "FsxDataRepositoryAccessViaS3",
                                "Condition": Match.object_like(
                                    {"StringEquals": Match.object_like({"kms:ViaService": "s3.us-east-1.amazonaws.com"})}
                                ),
                            }
                        )
                    ]
                )
            }
        },
    )


def test_bucket_names_are_stack_outputs(dev_templates, prod_templates):
    # trainium-runs and the upload instructions read these instead of a placeholder.
    for templates in (dev_templates, prod_templates):
        t = templates["storage"]
        outputs = t.to_json()["Outputs"]
        for output, bucket_id in (("DataBucketName", "DataBucket"), ("ArtifactsBucketName", "ArtifactsBucket")):
            (logical_id,) = t.find_resources("AWS::S3::Bucket", {"Properties": {
                "LoggingConfiguration": {"LogFilePrefix": f"{bucket_id}/"}}})
            assert outputs[output]["Value"] == {"Ref": logical_id}
