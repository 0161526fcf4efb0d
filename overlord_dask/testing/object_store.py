"""A real S3-compatible server on loopback (moto, as s3fs's own tests use), for the tests and for
the benchmarks that read sources from object storage. Credentials are moto's placeholders."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time

STORAGE_OPTIONS = {"key": "test", "secret": "test", "client_kwargs": {"region_name": "us-east-1"}}


def start_moto(timeout: float = 30.0) -> tuple[subprocess.Popen, str]:
    """Start ``moto_server`` on a free loopback port; returns (process, endpoint URL) once it accepts connections."""
    exe = shutil.which("moto_server") or os.path.join(os.path.dirname(sys.executable), "moto_server")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [exe, "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.time() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return proc, f"http://127.0.0.1:{port}"
        except OSError:
            if time.time() > deadline:
                proc.kill()
                raise
            time.sleep(0.1)


def storage_options(endpoint: str) -> dict:
    """fsspec ``storage_options`` (s3fs) for the server at ``endpoint``."""
    return {"endpoint_url": endpoint, **STORAGE_OPTIONS}


def create_bucket(endpoint: str, name: str) -> None:
    import boto3

    boto3.client(
        "s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="test", aws_secret_access_key="test"
    ).create_bucket(Bucket=name)
