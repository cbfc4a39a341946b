"""S3 access confined to key prefixes, for the roles that act for one team (its job role, its
access role). bucket.grant_read/grant_read_write allow s3:List* on the whole bucket, which names every
other team's runs; here listing is conditioned on the prefix too (s3:prefix,
https://docs.aws.amazon.com/AmazonS3/latest/userguide/amazon-s3-policy-keys.html) and the KMS key
grants come from the bucket's key (SSE-KMS reads decrypt, writes generate data keys).
"""

from __future__ import annotations

from collections.abc import Sequence

from aws_cdk import aws_iam as iam
from aws_cdk import aws_s3 as s3


def grant_prefixes(principal: iam.IGrantable, bucket: s3.IBucket, *, read: Sequence[str] = (),
                   write: Sequence[str] = (), delete: Sequence[str] = ()) -> None:
    """`principal` may list and get objects below `read` and `write`, put (and abort multipart
    uploads of) objects below `write`, delete objects below `delete`; each prefix ends with '/'."""
    for prefix in (*read, *write, *delete):
        assert prefix.endswith("/") and not prefix.startswith("/"), f"{prefix!r}: a key prefix like 'runs/team/'"
    readable = [*read, *(p for p in write if p not in read)]
    statements = [
        iam.PolicyStatement(actions=["s3:ListBucket"], resources=[bucket.bucket_arn],
                            conditions={"StringLike": {"s3:prefix": [f"{p}*" for p in readable]}}),
        iam.PolicyStatement(actions=["s3:GetObject"], resources=[bucket.arn_for_objects(f"{p}*") for p in readable]),
    ]
    if write:
        statements.append(iam.PolicyStatement(actions=["s3:PutObject", "s3:AbortMultipartUpload"],
                                              resources=[bucket.arn_for_objects(f"{p}*") for p in write]))
    if delete:
        statements.append(iam.PolicyStatement(actions=["s3:DeleteObject"],
                                              resources=[bucket.arn_for_objects(f"{p}*") for p in delete]))
    for statement in statements:
        principal.grant_principal.add_to_principal_policy(statement)
    key = bucket.encryption_key
    if key is not None:
        (key.grant_encrypt_decrypt if write else key.grant_decrypt)(principal)
