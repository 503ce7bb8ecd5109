"""Which names are storage URIs, and the pyarrow filesystem each one is read and written through."""

from __future__ import annotations

import os
from urllib.parse import urlsplit

import pyarrow.fs as pafs

URI_SCHEMES = ("s3://", "gs://", "gcs://", "file://", "hdfs://")
S3_ENDPOINT_ENV = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
"""S3-compatible stores (MinIO, Ceph, R2, moto) are named by these, as the AWS CLI does."""


def is_uri(name: str) -> bool:
    return name.startswith(URI_SCHEMES)


def filesystem_of(uri: str) -> tuple[pafs.FileSystem, str]:
    """The filesystem and its path for `uri`; an s3:// URI goes to $AWS_ENDPOINT_URL(_S3) when set.

    pyarrow reads the endpoint variable only when S3 is first initialised in a process, so it is
    passed explicitly here.
    """
    endpoint = next((os.environ[key] for key in S3_ENDPOINT_ENV if os.environ.get(key)), None)
    if uri.startswith("s3://") and endpoint and "endpoint_override=" not in uri:
        parts = urlsplit(endpoint)
        query = f"endpoint_override={parts.netloc or parts.path}&scheme={parts.scheme or 'https'}"
        uri = f"{uri}{'&' if '?' in uri else '?'}{query}"
    return pafs.FileSystem.from_uri(uri)
