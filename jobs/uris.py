"""Which names are storage URIs, and the pyarrow filesystem each one is read and written through."""

from __future__ import annotations

import os
from urllib.parse import urlsplit

import pyarrow.fs as pafs

UNSUPPORTED_SCHEMES = ("gs://", "gcs://")
"""Recognised as URIs (never taken for a local folder named `gs:`) but refused: pyarrow's GCS filesystem
waits up to 15 min for credentials (the metadata server) and ignores Ctrl-C meanwhile, and a job lease
needs S3's conditional writes."""
URI_SCHEMES = ("s3://", "file://", "hdfs://", *UNSUPPORTED_SCHEMES)
S3_ENDPOINT_ENV = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
"""S3-compatible stores (MinIO, Ceph, R2, moto) are named by these, as the AWS CLI does."""


class UnsupportedURIError(ValueError):
    """A storage URI kvbatch refuses (gs://); the message says what to use instead."""


def is_uri(name: str) -> bool:
    return name.startswith(URI_SCHEMES)


def check_supported(uri: str) -> None:
    """Raises `UnsupportedURIError` for a gs:// (or gcs://) URI, before any call that could wait on it."""
    if uri.startswith(UNSUPPORTED_SCHEMES):
        raise UnsupportedURIError(
            f"{uri}: gs:// is not supported: use s3:// (any S3-compatible store; GCS has an S3 interoperability "
            "endpoint: AWS_ENDPOINT_URL=https://storage.googleapis.com with HMAC keys) or a local or file:// path"
        )


def filesystem_of(uri: str) -> tuple[pafs.FileSystem, str]:
    """The filesystem and its path for `uri`; an s3:// URI goes to $AWS_ENDPOINT_URL(_S3) when set.

    pyarrow reads the endpoint variable only when S3 is first initialised in a process, so it is
    passed explicitly here. A gs:// URI raises `UnsupportedURIError`.
    """
    check_supported(uri)
    endpoint = next((os.environ[key] for key in S3_ENDPOINT_ENV if os.environ.get(key)), None)
    if uri.startswith("s3://") and endpoint and "endpoint_override=" not in uri:
        parts = urlsplit(endpoint)
        query = f"endpoint_override={parts.netloc or parts.path}&scheme={parts.scheme or 'https'}"
        uri = f"{uri}{'&' if '?' in uri else '?'}{query}"
    return pafs.FileSystem.from_uri(uri)
