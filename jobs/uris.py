"""Which names are storage URIs (read through pyarrow's filesystems) rather than local paths."""

from __future__ import annotations

URI_SCHEMES = ("s3://", "gs://", "gcs://", "file://", "hdfs://")


def is_uri(name: str) -> bool:
    return name.startswith(URI_SCHEMES)
