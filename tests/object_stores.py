"""Object stores on loopback for the tests: a GCS emulator (gcp-storage-emulator) and S3 (moto's server).

Each is a real HTTP server in a thread of the test process; the variables the
clients read (:data:`Store.env`) point every client at it: gcsfs and the Google
libraries (STORAGE_EMULATOR_HOST), TensorStore's GCS driver
(TENSORSTORE_GCS_HTTP_URL), s3fs/boto3 (AWS_ENDPOINT_URL, fake credentials).
Subprocesses inherit them.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

from tests.processes import free_port


@dataclass
class Store:
    """A running store: its scheme (``gs``/``s3``), the variables that point clients at it, and a way to make
    buckets."""

    scheme: str
    env: dict[str, str] = field(default_factory=dict)

    def bucket(self) -> str:
        """A new empty bucket; its URL (``gs://name``)."""
        name = f"b{uuid.uuid4().hex[:12]}"
        if self.scheme == "gs":
            from google.auth.credentials import AnonymousCredentials
            from google.cloud import storage

            storage.Client(project="test", credentials=AnonymousCredentials()).create_bucket(name)
        else:
            import boto3

            boto3.client("s3", region_name="us-east-1").create_bucket(Bucket=name)
        return f"{self.scheme}://{name}"


@contextlib.contextmanager
def _env(values: dict[str, str]) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _send_generations() -> None:
    """Make the emulator's downloads carry ``x-goog-generation`` and ``x-goog-metageneration``, as GCS's do.

    TensorStore's GCS driver reads an object's generation from them and makes
    its next write of that object conditional on it (OCDBT's manifest is read,
    then rewritten, when a save commits in more than one batch); without them
    it has a generation it cannot send back ("Malformed StorageGeneration").
    """
    from gcp_storage_emulator import server
    from gcp_storage_emulator.handlers import objects

    plain = objects.download
    if getattr(plain, "sends_generations", False):
        return

    def download(request, response, storage, *args, **kwargs):
        plain(request, response, storage, *args, **kwargs)
        try:
            obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
        except Exception:  # not found: the plain handler has answered 404
            return
        response["x-goog-generation"] = str(obj["generation"])
        response["x-goog-metageneration"] = str(obj["metageneration"])

    download.sends_generations = True
    objects.download = download  # objects.get calls it by this name for ?alt=media
    for _, methods in server.HANDLERS:
        for method, handler in methods.items():
            if handler is plain:
                methods[method] = download


@contextlib.contextmanager
def gcs_store() -> Iterator[Store]:
    """The GCS emulator on a free loopback port, in memory."""
    from gcp_storage_emulator.server import create_server

    _send_generations()
    port = free_port()
    server = create_server("127.0.0.1", port, in_memory=True)
    server.start()
    url = f"http://127.0.0.1:{port}"
    # gcsfs asks GCS's control plane (gRPC) for each bucket's type by default: 60 s a call against an emulator.
    env = {"STORAGE_EMULATOR_HOST": url, "TENSORSTORE_GCS_HTTP_URL": url,
           "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false", "GOOGLE_CLOUD_PROJECT": "test"}
    try:
        with _env(env):
            yield Store("gs", env)
    finally:
        server.stop()


@contextlib.contextmanager
def s3_store() -> Iterator[Store]:
    """moto's S3 server on a free loopback port (fake credentials, region us-east-1)."""
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    url = f"http://127.0.0.1:{port}"
    env = {"AWS_ENDPOINT_URL": url, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_REGION": "us-east-1"}
    try:
        with _env(env):
            yield Store("s3", env)
    finally:
        server.stop()
