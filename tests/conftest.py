"""Shared fixtures.

S3: ``moto_server`` (session) is a real moto S3 server process reached over
HTTP; ``s3_bucket`` gives each test a fresh bucket on it; ``s3_proxy`` puts a
:class:`s3util.FaultProxy` between a test and that server. While any S3
fixture is alive the process environment holds fake AWS credentials (see
``s3util.FAKE_AWS_ENV``); they are set once per session and removed when the
session ends, so tests that do not use S3 see them only if they run after one
that did, and nothing can reach real AWS with them.
"""

from __future__ import annotations

import os
import sys
import uuid

import pytest

# the helpers live beside the tests, which are not a package
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from s3util import FAKE_AWS_ENV, FaultProxy, start_moto_server, stop_moto_server  # noqa: E402


# -- S3 ----------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def fake_aws_env():
    """Fake AWS credentials and region in ``os.environ`` for the rest of the session."""
    with pytest.MonkeyPatch.context() as mp:
        for name in ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
            mp.delenv(name, raising=False)
        for name, value in FAKE_AWS_ENV.items():
            mp.setenv(name, value)
        yield


@pytest.fixture(scope="session")
def moto_server(fake_aws_env):
    """URL (``http://127.0.0.1:<port>``) of a moto S3 server process shared by the session."""
    proc, url = start_moto_server()
    try:
        yield url
    finally:
        stop_moto_server(proc)


def _s3_client(endpoint_url: str):
    import boto3

    return boto3.client("s3", endpoint_url=endpoint_url, region_name="us-east-1")


@pytest.fixture
def s3_bucket(moto_server):
    """``(endpoint_url, bucket)``: a new, empty bucket on the moto server."""
    bucket = f"test-{uuid.uuid4().hex[:20]}"
    client = _s3_client(moto_server)
    client.create_bucket(Bucket=bucket)
    try:
        yield moto_server, bucket
    finally:
        client.close()


@pytest.fixture
def s3_proxy(moto_server):
    """A :class:`FaultProxy` in front of the moto server; ``.url`` is its endpoint."""
    with FaultProxy(moto_server) as proxy:
        yield proxy
