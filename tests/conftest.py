"""Shared fixtures: a small generated corpus (real parquet and zarr files) and one real
LocalCluster of worker *processes* for the integration tests."""

from __future__ import annotations

import os

import pytest
from hypothesis import settings

from overlord_dask.service.demo import demo_plan, generate_demo_corpus

# CI runs the same hypothesis examples every time (a submission must not fail by chance);
# local runs keep exploring new ones.
settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """The demo corpus at 1/10 scale: web (parquet text), chat (parquet tokens), books (zarr)."""
    return generate_demo_corpus(tmp_path_factory.mktemp("corpus"), scale=0.1, seed=7)


@pytest.fixture
def small_plan(corpus):
    """The demo plan with a small topology so that tests run many steps quickly."""

    def make(**overrides):
        topo = {"dp": 3, "micro_batches": 2, "tokens_per_micro_batch": 4096, **overrides.pop("topology", {})}
        loading = {"unit_rows": 300, "unit_tokens": 65536, "prefetch_steps": 3, **overrides.pop("loading", {})}
        return demo_plan(corpus, topology=topo, loading=loading, **overrides)

    return make


@pytest.fixture(scope="session")
def cluster():
    from overlord_dask.service.deploy import local_cluster

    c = local_cluster(n_workers=2, threads_per_worker=1)
    yield c
    c.close()


def pytest_configure(config):
    os.environ.setdefault("DASK_DISTRIBUTED__LOGGING__DISTRIBUTED", "warning")


INTEGRATION_FIXTURES = {"cluster", "s3_server"}  # a test that asks for one of these is an integration test


def pytest_collection_modifyitems(config, items):
    """Two sets: the quick unit tests (``pytest -m "not integration"``: no cluster, service,
    process or server) and the integration tests (``pytest -m integration``); CI runs both. A
    test is marked ``integration`` by its module or its own decorator, and any test that asks
    for a cluster or an object store is one whatever its marks say."""
    for item in items:
        if INTEGRATION_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.integration)


@pytest.fixture(scope="session")
def s3_server():
    """A real S3-compatible server (moto) on loopback, with the bucket ``overlord``."""
    from overlord_dask.testing.object_store import create_bucket, start_moto

    proc, endpoint = start_moto()
    create_bucket(endpoint, "overlord")
    yield endpoint
    proc.terminate()
    proc.wait(timeout=10)
