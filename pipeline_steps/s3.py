"""S3 objects for the steps that read or write them (validate, export): s3:// URIs, the client, and
boto3 errors mapped to the exit-code table."""

from __future__ import annotations

import logging
from typing import Any

from .errors import BadConfigError, RetryableError

log = logging.getLogger(__name__)


def split_uri(uri: str) -> tuple[str, str]:
    bucket, _, key = uri[len("s3://"):].partition("/")
    if not uri.startswith("s3://") or not bucket or not key:
        raise BadConfigError(f"not an S3 object URI: {uri!r}; expected s3://bucket/key")
    return bucket, key


def client() -> Any:
    try:
        import boto3
    except ImportError:
        raise BadConfigError("s3:// URIs need boto3: `pip install boto3` (the training image has it), "
                             "or pass local paths") from None
    return boto3.client("s3")


def step_error(exc: Exception, uri: str, action: str) -> Exception:
    """Map a boto3 error to the exit-code table: permissions/config -> 78, transient -> 75."""
    from botocore.exceptions import ClientError, NoCredentialsError

    if isinstance(exc, NoCredentialsError):
        return BadConfigError(f"cannot {action} {uri}: no AWS credentials (set a profile or an instance role)")
    code = exc.response.get("Error", {}).get("Code", "") if isinstance(exc, ClientError) else ""
    if code in ("AccessDenied", "403", "NoSuchBucket", "InvalidBucketName", "AllAccessDisabled"):
        return BadConfigError(f"cannot {action} {uri}: {code}; check the bucket name and the job role's "
                              "s3 permissions")
    return RetryableError(f"cannot {action} {uri}: {exc}")


def put_json(data: bytes, uri: str) -> None:
    """Upload a JSON document (the gate decision) to an s3:// URI."""
    from botocore.exceptions import BotoCoreError, ClientError

    bucket, key = split_uri(uri)
    try:
        client().put_object(Bucket=bucket, Key=key, Body=data, ContentType="application/json")
    except (ClientError, BotoCoreError) as exc:
        raise step_error(exc, uri, "write") from exc
    log.info("uploaded %s", uri)
