"""``s3://`` for Orbax's arrays: TensorStore's own S3 driver under orbax-checkpoint 0.12.8's path handling.

Orbax builds every TensorStore spec in one function (``tensorstore_utils.build_kvstore_tspec``), which knows
``gs://`` (TensorStore's GCS driver) and absolute local paths only: an ``s3://`` URL is normalized to ``s3:/`` and
refused as "not absolute" (google/orbax#359). TensorStore itself has an S3 driver. :func:`install` teaches that one
function the ``s3://`` scheme, so Orbax's saves, restores and multi-process OCDBT merges write and read S3 objects
directly; everything else Orbax does on a bucket (its metadata files through ``etils.epath``, over ``s3fs``) already
works. An S3 bucket has no atomic rename either, so checkpoints there are committed the way Orbax commits them on GCS:
:data:`BUCKET_ATOMICITY` (a step is finished once its ``commit_success.txt`` exists).

The endpoint and region are the ones boto3 and s3fs read (``AWS_ENDPOINT_URL_S3`` or ``AWS_ENDPOINT_URL``,
``AWS_REGION`` or ``AWS_DEFAULT_REGION``); credentials are TensorStore's default chain (the same variables, the
shared credentials file, the instance's metadata).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any
from urllib.parse import urlparse

import orbax.checkpoint as ocp

from zoo.errors import UserError

PREFIX = "s3://"
# Orbax's commit-file protocol (its default on gs://), for every bucket: a step folder is written in place and
# counts as finished once commit_success.txt is in it; a rename would be a copy of every object.
BUCKET_ATOMICITY = ocp.options.AtomicityOptions(mode=ocp.options.AtomicityMode.COMMIT_FILE)

_installed = False


def s3_kvstore(url: str) -> dict[str, Any]:
    """TensorStore's ``s3`` kvstore spec for ``url`` (``s3://bucket/key/prefix``), with the endpoint and region
    the environment names (as boto3 reads them), so a store other than AWS (MinIO, moto) is reached the same way."""
    parsed = urlparse(url)
    spec: dict[str, Any] = {"driver": "s3", "bucket": parsed.netloc, "path": parsed.path.lstrip("/")}
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        spec["endpoint"] = endpoint
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region:
        spec["aws_region"] = region
    return spec


def _keep_s3(normalize: Callable[[str], str]) -> Callable[[str], str]:
    # Orbax's normalization (os.path.normpath) folds "s3://" to "s3:/"; applied to the rest, it keeps the scheme.
    def normalized(path: str) -> str:
        if path.startswith(PREFIX):
            return PREFIX + normalize(path.removeprefix(PREFIX)).lstrip("/")
        return normalize(path)

    return normalized


def _remote_for_s3(use_gcs_driver: Callable[[str], bool]) -> Callable[[str], bool]:
    # The flag that routes a path to a bucket's kvstore spec (and past the "absolute path" check).
    def remote(directory: str) -> bool:
        return directory.startswith(PREFIX) or use_gcs_driver(directory)

    return remote


def _s3_spec_or_gcs(gcs_spec: Callable[[str], dict[str, Any]]) -> Callable[[str], dict[str, Any]]:
    # The bucket branch asks gcs_utils for its spec: an s3:// path gets TensorStore's s3 driver instead.
    def spec(path: str) -> dict[str, Any]:
        return s3_kvstore(path) if path.startswith(PREFIX) else gcs_spec(path)

    return spec


def install() -> None:
    """Let Orbax read and write ``s3://`` arrays through TensorStore's S3 driver (idempotent; call before the
    first save or restore on an ``s3://`` path). Only the three private functions named above change, each
    wrapped so that every other path takes Orbax's own code."""
    global _installed
    if _installed:
        return
    from orbax.checkpoint._src.serialization import tensorstore_utils as tsu

    # Checked rather than assumed: a newer Orbax that moved these would otherwise fail later, inside a save.
    for name in ("_normalize_path", "_use_gcs_driver"):
        if not callable(getattr(tsu, name, None)):
            raise UserError(f"s3:// checkpoints: orbax-checkpoint {ocp.__version__} has no tensorstore_utils.{name} "
                            f"(zoo/orbax_s3.py knows 0.12); pip install 'orbax-checkpoint==0.12.8'")
    tsu._normalize_path = _keep_s3(tsu._normalize_path)
    tsu._use_gcs_driver = _remote_for_s3(tsu._use_gcs_driver)
    tsu.gcs_utils.get_kvstore_for_gcs = _s3_spec_or_gcs(tsu.gcs_utils.get_kvstore_for_gcs)
    _installed = True
