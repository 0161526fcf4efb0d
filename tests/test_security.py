"""Dask TLS end to end: scheduler, workers and trainers speak TLS when the Dask config holds
certificates (here through DASK_* environment variables, as on a cluster), and a trainer without
a certificate the service's CA signed is refused."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from distributed.security import Security

pytestmark = pytest.mark.integration  # (tests/conftest.py: the quick set is -m 'not integration')

ROOT = Path(__file__).resolve().parents[1]

TRAINER = """
import json, sys
from overlord_dask import connect
with connect(sys.argv[1], int(sys.argv[2]), timeout=30, reconnect_timeout=5) as s:
    steps = [s.next_batch()["step"] for _ in range(3)]
    channel = type(s.rio.channel).__name__
print(json.dumps({"steps": steps, "channel": channel}))
"""


def _tls_env(tmp_path: Path, name: str) -> dict:
    """Dask's TLS settings for every role from one temporary self-signed certificate."""
    sec = Security.temporary()
    (tmp_path / f"{name}.pem").write_text(sec.tls_ca_file)
    (tmp_path / f"{name}.key").write_text(sec.tls_scheduler_key)
    cert, key = str(tmp_path / f"{name}.pem"), str(tmp_path / f"{name}.key")
    env = {"DASK_DISTRIBUTED__COMM__TLS__CA_FILE": cert, "DASK_DISTRIBUTED__COMM__REQUIRE_ENCRYPTION": "True"}
    for role in ("SCHEDULER", "WORKER", "CLIENT"):
        env[f"DASK_DISTRIBUTED__COMM__TLS__{role}__CERT"] = cert
        env[f"DASK_DISTRIBUTED__COMM__TLS__{role}__KEY"] = key
    return {**os.environ, **env}


def _trainer(address: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", TRAINER, address, "0"], capture_output=True, text=True, timeout=120, cwd=ROOT, env=env
    )


def test_tls_end_to_end_and_a_trainer_without_the_certificate_is_refused(tmp_path, corpus):
    plan = yaml.safe_load((ROOT / "overlord_dask" / "service" / "demo_plan.yaml").read_text())
    for s in plan["sources"]:
        s["url"] = str(Path(corpus) / s["url"])
    plan["topology"].update(dp=1, micro_batches=1, tokens_per_micro_batch=4096)
    plan_file = tmp_path / "plan.yaml"
    plan_file.write_text(yaml.safe_dump(plan))
    env = _tls_env(tmp_path, "service")
    proc = subprocess.Popen(
        [sys.executable, "-m", "overlord_dask", "serve", str(plan_file), "--workers", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=env,
        start_new_session=True,
    )
    try:
        address = json.loads(proc.stdout.readline())["address"]
        assert address.startswith("tls://127.0.0.1:")  # encrypted, and on loopback unless --host says otherwise
        ok = _trainer(address, env)
        assert ok.returncode == 0, ok.stderr[-2000:]
        assert json.loads(ok.stdout.strip().splitlines()[-1]) == {"steps": [0, 1, 2], "channel": "Channel"}
        if sys.platform.startswith("linux"):  # as under torchrun: the host's relay holds the TLS channel
            relayed = _trainer(address, {**env, "LOCAL_WORLD_SIZE": "2"})
            assert relayed.returncode == 0, relayed.stderr[-2000:]
            assert json.loads(relayed.stdout.strip().splitlines()[-1]) == {  # (step 2 was held, not finished)
                "steps": [2, 3, 4],
                "channel": "RelayChannel",
            }
        plain = {k: v for k, v in os.environ.items() if not k.startswith("DASK_DISTRIBUTED__COMM__")}
        refused = _trainer(address, plain)  # no certificate at all
        assert refused.returncode != 0 and "steps" not in refused.stdout
        assert "TLS" in refused.stderr or "tls" in refused.stderr or "SSL" in refused.stderr, refused.stderr[-2000:]
        stranger = _trainer(address, _tls_env(tmp_path, "stranger"))  # a certificate from another CA
        assert stranger.returncode != 0 and "steps" not in stranger.stdout, stranger.stdout
        stop = subprocess.run(
            [sys.executable, "-m", "overlord_dask", "stop", address],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=ROOT,
            env=env,
        )
        assert stop.returncode == 0, stop.stderr[-2000:]
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
