"""Across hosts: the service, two "hosts" of loader workers and the trainers are separate process
groups that meet only through the scheduler's address (as on a cluster, where each is a
different machine). Killing one host's whole process group mid-run loses and repeats nothing."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import yaml

from overlord_dask import Service
from overlord_dask.report import exactly_once, planned_identities

ROOT = Path(__file__).resolve().parents[1]

TRAINERS = """
import json, sys, threading, time
import numpy as np
from overlord_dask import connect
from overlord_dask.report import delivered_identities, delivered_record
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


def _group(args: list[str], **kw) -> subprocess.Popen:
    return subprocess.Popen(args, cwd=ROOT, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, **kw)


def test_a_whole_host_of_workers_dies_and_the_run_goes_on(tmp_path, corpus):
    plan = yaml.safe_load((ROOT / "overlord_dask" / "demo_plan.yaml").read_text())
    for s in plan["sources"]:
        s["url"] = str(Path(corpus) / s["url"])
    plan["topology"].update(dp=2, micro_batches=1, tokens_per_micro_batch=4096)
    plan["loading"] = {"unit_rows": 300, "unit_tokens": 65536, "prefetch_steps": 4}
    plan_file = tmp_path / "plan.yaml"
    plan_file.write_text(yaml.safe_dump(plan))
    steps = 40
    groups = []
    try:
        service = _group([sys.executable, "-m", "overlord_dask.cli", "serve", str(plan_file), "--workers", "0"])
        groups.append(service)
        address = json.loads(service.stdout.readline())["address"]
        hosts = [_group([sys.executable, "-m", "distributed.cli.dask_worker", address, "--nworkers", "1", "--nthreads", "1",
                         "--name", f"host{h}", "--no-dashboard"]) for h in "AB"]
        groups += hosts
        trainers = _group([sys.executable, "-c", TRAINERS, address, str(steps), str(tmp_path / "got.json")])
        groups.append(trainers)
        with Service.attach(address) as svc:
            deadline = time.monotonic() + 120
            while svc.status()["committed"] < 10 and time.monotonic() < deadline:
                time.sleep(0.1)
            os.killpg(hosts[0].pid, signal.SIGKILL)  # host A goes away: its worker, its nanny, its blocks and batches
            assert trainers.wait(timeout=300) == 0
            ledger = svc.ledger(0, steps)
            st = svc.status()
        got = json.loads((tmp_path / "got.json").read_text())
        delivered = [np.asarray(v, dtype=np.int64).reshape(-1, 4) for v in got.values()]
        assert exactly_once([planned_identities(ledger[s]) for s in range(steps)], delivered) == (0, 0)
        assert st["committed"] >= steps - 1 and st["failure"] is None
    finally:
        for p in groups:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
