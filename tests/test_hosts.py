"""Across hosts: the service, two "hosts" of loader workers and the trainers are separate process
groups that meet only through the scheduler's address (as on a cluster, where each is a
different machine). Killing one host's whole process group mid-run loses and repeats nothing.

Where the machine allows it (root, ``ip netns``), the same runs with each host in a network
namespace of its own, joined by a bridge on addresses the test makes (10.231.0.0/24): the
service listens on its bridge address only, and nothing can take a loopback shortcut."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from overlord_dask import Service
from overlord_dask.observe.figures import exactly_once, planned_identities

pytestmark = pytest.mark.integration  # (tests/conftest.py: the quick set is -m 'not integration')

ROOT = Path(__file__).resolve().parents[1]

TRAINERS = """
import json, sys, threading, time
import numpy as np
from overlord_dask import connect
from overlord_dask.observe.figures import delivered_identities, delivered_record
address, steps, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
got = {}
def rank(r):
    with connect(address, r, timeout=120) as s:
        ids = []
        for _ in range(steps):
            ids.append(delivered_identities(delivered_record(s.next_batch())))
            time.sleep(0.05)
        s.commit()
    got[r] = np.concatenate(ids).tolist()
threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
for t in threads: t.start()
for t in threads: t.join()
json.dump(got, open(out, "w"))
"""


def _group(args: list[str], netns: str | None = None, **kw) -> subprocess.Popen:
    args = ["ip", "netns", "exec", netns, *args] if netns else args
    return subprocess.Popen(
        args, cwd=ROOT, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, **kw
    )


def _sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, timeout=30)


NETS = {"svc": "10.231.0.1", "hostA": "10.231.0.2", "hostB": "10.231.0.3", "train": "10.231.0.4"}


@pytest.fixture
def namespaces():
    """Four network namespaces on one bridge (service, two worker hosts, trainers), or a skip."""
    tag = f"ovl{os.getpid() % 10000}"
    names = {k: f"{tag}{k}" for k in NETS}

    def cleanup():
        for ns in names.values():
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", f"{tag}br"], capture_output=True)

    try:
        _sh("ip", "link", "add", f"{tag}br", "type", "bridge")
        _sh("ip", "link", "set", f"{tag}br", "up")
        for k, ns in names.items():
            _sh("ip", "netns", "add", ns)
            _sh("ip", "link", "add", f"{tag}{k}0", "type", "veth", "peer", "name", f"{tag}{k}1")
            _sh("ip", "link", "set", f"{tag}{k}0", "master", f"{tag}br", "up")
            _sh("ip", "link", "set", f"{tag}{k}1", "netns", ns)
            _sh("ip", "-n", ns, "addr", "add", f"{NETS[k]}/24", "dev", f"{tag}{k}1")
            _sh("ip", "-n", ns, "link", "set", f"{tag}{k}1", "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as err:
        cleanup()
        pytest.skip(f"network namespaces need root and iproute2 (ip netns) on this machine: {err}")
    try:
        yield names
    finally:
        cleanup()


def test_a_whole_host_of_workers_dies_and_the_run_goes_on(tmp_path, corpus):
    _run_across_hosts(tmp_path, corpus, None)


def test_the_same_across_network_namespaces(tmp_path, corpus, namespaces):
    _run_across_hosts(tmp_path, corpus, namespaces)


def _run_across_hosts(tmp_path, corpus, netns: dict | None):
    plan = yaml.safe_load((ROOT / "overlord_dask" / "service" / "demo_plan.yaml").read_text())
    for s in plan["sources"]:
        s["url"] = str(Path(corpus) / s["url"])
    plan["topology"].update(dp=2, micro_batches=1, tokens_per_micro_batch=4096)
    plan["loading"] = {"unit_rows": 300, "unit_tokens": 65536, "prefetch_steps": 4}
    plan_file = tmp_path / "plan.yaml"
    plan_file.write_text(yaml.safe_dump(plan))
    steps = 40
    groups = []
    try:
        ns = netns or {}
        host = ["--host", NETS["svc"]] if netns else []
        service = _group(
            [sys.executable, "-m", "overlord_dask", "serve", str(plan_file), "--workers", "0", *host], ns.get("svc")
        )
        groups.append(service)
        address = json.loads(service.stdout.readline())["address"]
        assert not netns or address.startswith(f"tcp://{NETS['svc']}:")
        hosts = [
            _group(
                [
                    sys.executable,
                    "-m",
                    "distributed.cli.dask_worker",
                    address,
                    "--nworkers",
                    "1",
                    "--nthreads",
                    "1",
                    "--name",
                    f"host{h}",
                    "--no-dashboard",
                    *(["--host", NETS[f"host{h}"]] if netns else []),
                ],
                ns.get(f"host{h}"),
            )
            for h in "AB"
        ]
        groups += hosts
        trainers = _group(
            [sys.executable, "-c", TRAINERS, address, str(steps), str(tmp_path / "got.json")], ns.get("train")
        )
        groups.append(trainers)
        if netns:  # this process is in none of the namespaces: watch through the trainers' one
            watch = _group([sys.executable, "-c", WATCH, address, str(steps)], ns["train"])
            groups.append(watch)
            assert json.loads(watch.stdout.readline())["committed"] >= 10
            os.killpg(hosts[0].pid, signal.SIGKILL)
            assert trainers.wait(timeout=300) == 0
            result = json.loads(watch.stdout.readline())
            ledger = {
                int(k): {
                    "pieces": np.asarray(v["pieces"], np.int64).reshape(-1, 6),
                    "sample_ids": np.asarray(v["ids"], np.int64),
                }
                for k, v in result["ledger"].items()
            }
            st = result["status"]
        else:
            ledger, st = _watch_and_kill(address, steps, hosts[0], trainers)
        got = json.loads((tmp_path / "got.json").read_text())
        delivered = [np.asarray(v, dtype=np.int64).reshape(-1, 4) for v in got.values()]
        assert exactly_once([planned_identities(ledger[s]) for s in range(steps)], delivered) == (0, 0)
        assert st["committed"] >= steps - 1 and st["failure"] is None
    finally:
        for p in groups:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


WATCH = """
import json, sys, time
from overlord_dask import Service
address, steps = sys.argv[1], int(sys.argv[2])
with Service.attach(address) as svc:
    while svc.status()["committed"] < 10:
        time.sleep(0.1)
    print(json.dumps({"committed": svc.status()["committed"]}), flush=True)
    while svc.status()["committed"] < steps - 1 and not svc.status()["failure"]:
        time.sleep(0.2)
    ledger = {s: {"pieces": e["pieces"].ravel().tolist(), "ids": e["sample_ids"].tolist()}
              for s, e in svc.ledger(0, steps).items()}
    print(json.dumps({"ledger": ledger, "status": {k: svc.status()[k] for k in ("committed", "failure")}}), flush=True)
"""


def _watch_and_kill(address: str, steps: int, host, trainers):
    with Service.attach(address) as svc:
        deadline = time.monotonic() + 120
        while svc.status()["committed"] < 10 and time.monotonic() < deadline:
            time.sleep(0.1)
        os.killpg(host.pid, signal.SIGKILL)  # host A goes away: its worker, its nanny, its blocks and batches
        assert trainers.wait(timeout=300) == 0
        return svc.ledger(0, steps), svc.status()
