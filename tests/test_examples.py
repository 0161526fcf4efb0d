"""The recipes in ``examples/`` run as users run them: ``torchrun`` with 2-4 processes on the CPU
(gloo), tiny models built from a config with random weights, a few steps, fed by a real service
started here. Each recipe's test checks what the recipe promises."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from overlord_dask import Service

from .harness import example_plan

pytestmark = pytest.mark.integration  # (tests/conftest.py: the quick set is -m 'not integration')

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def _plan(corpus, dp: int):
    """The plan the recipes' docs name (pipelines/small.yaml), on the test corpus."""
    topology = yaml.safe_load((ROOT / "pipelines" / "small.yaml").read_text())["topology"]
    return example_plan("small", corpus, topology={**topology, "dp": dp})


def _torchrun(script: str, nproc: int, *args, wait: bool = True, timeout: float = 300):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(nproc),
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(port),
        str(EXAMPLES / script),
        *map(str, args),
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    if not wait:
        return subprocess.Popen(
            cmd, cwd=ROOT, env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL torchrun and every process under it (its workers run in sessions of their own)."""
    import psutil

    procs = [proc.pid] + [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
    for pid in procs:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=60)
    psutil.wait_procs([p for p in map(_process, procs[1:]) if p is not None], timeout=60)


def _process(pid: int):
    import psutil

    try:
        return psutil.Process(pid)
    except psutil.NoSuchProcess:
        return None


def _records(path: Path, ranks: int) -> list[list[dict]]:
    return [[json.loads(line) for line in open(f"{path}.rank{r}")] for r in range(ranks)]


def test_a_document_loses_the_same_packed_or_alone():
    """With the document mask, a packed document's per-token loss equals its loss alone (Hugging
    Face Llama, SDPA): packing changes nothing a document learns."""
    from examples.ddp_hf_llama import tiny_llama
    from overlord_dask.trainer.masks import document_mask

    torch.manual_seed(0)
    model = tiny_llama(300).eval()
    docs = [torch.randint(3, 300, (n,)) for n in (17, 9, 23)]
    ids = torch.cat(docs + [torch.zeros(7, dtype=torch.long)])[None]  # padded to 56
    cu = torch.tensor([0, 17, 26, 49])
    pos = torch.cat([torch.arange(len(d)) for d in docs] + [torch.arange(7)])[None]
    with torch.no_grad():
        packed = model(ids, position_ids=pos, attention_mask=document_mask(cu, ids.shape[1])).logits[0]
        for k, d in enumerate(docs):
            alone = model(d[None], position_ids=torch.arange(len(d))[None]).logits[0]
            piece = packed[cu[k] : cu[k + 1]]
            loss_packed = torch.nn.functional.cross_entropy(piece[:-1], d[1:])
            loss_alone = torch.nn.functional.cross_entropy(alone[:-1], d[1:])
            assert torch.allclose(loss_packed, loss_alone, atol=1e-5), (k, loss_packed, loss_alone)


def test_ddp_recipe_trains_a_hf_llama_on_every_rank(cluster, corpus, tmp_path):
    with Service.start(_plan(corpus, 2), cluster=cluster) as service:
        out = _torchrun("ddp_hf_llama.py", 2, "--address", service.address, "--steps", 4, "--record", tmp_path / "rec")
        assert "this job starts at step 0: the run's first" in out.stdout and "step 3: loss" in out.stdout
        metrics = service.metrics(0, 4)
        # a second job without a checkpoint: --steps counts its own steps, from where the run is
        out = _torchrun("ddp_hf_llama.py", 2, "--address", service.address, "--steps", 3, "--record", tmp_path / "b")
        assert "this job starts at step 4: the first step the ranks of the previous job had not" in out.stdout
    assert [r["step"] for r in _records(tmp_path / "b", 2)[0]] == [4, 5, 6]
    recs = _records(tmp_path / "rec", 2)
    assert [r["step"] for r in recs[0]] == [r["step"] for r in recs[1]] == [0, 1, 2, 3]
    for a, b, m in zip(*recs, metrics):
        assert a["loss"] == pytest.approx(b["loss"]) and 5.0 < a["loss"] < 7.0  # all-reduced; ln(512) at the start
        assert a["tokens"] == b["tokens"] == m["loss_tokens"][1]  # the step's loss tokens, HF's convention


def test_fsdp2_recipe_killed_mid_run_resumes_from_its_dcp_checkpoint_exactly(cluster, corpus, tmp_path):
    """The job is SIGKILLed (every process) after step 5, its last checkpoint at step 4; started
    again, it resumes from there while the service runs on (the service goes back to step 4): the
    loss and the batches of every step equal those of an uninterrupted run."""
    plan = _plan(corpus, 2)
    args = ["--steps", 9, "--checkpoint-every", 4]
    with Service.start(plan, cluster=cluster) as service:
        _torchrun(
            "fsdp2_dcp.py",
            2,
            "--address",
            service.address,
            *args,
            "--checkpoint-dir",
            tmp_path / "a",
            "--record",
            tmp_path / "a.rec",
        )
    with Service.start(plan, cluster=cluster) as service:
        job = _torchrun(
            "fsdp2_dcp.py",
            2,
            "--address",
            service.address,
            *args,
            "--checkpoint-dir",
            tmp_path / "b",
            "--record",
            tmp_path / "b.rec",
            wait=False,
        )
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and job.poll() is None:
            try:
                if len(_records(tmp_path / "b.rec", 2)[0]) >= 6:
                    break
            except (FileNotFoundError, json.JSONDecodeError):
                pass
            time.sleep(0.05)
        _kill_tree(job)
        killed_at = [len(r) for r in _records(tmp_path / "b.rec", 2)]  # steps each rank finished before the kill
        resume_at = int((tmp_path / "b" / "latest").read_text().split("-")[1])  # the last complete checkpoint
        assert resume_at == 4 < min(killed_at) and max(killed_at) < 8
        _torchrun(
            "fsdp2_dcp.py",
            2,
            "--address",
            service.address,
            *args,
            "--checkpoint-dir",
            tmp_path / "b",
            "--record",
            tmp_path / "b.rec",
        )
        again = _torchrun(  # the run is done: the same command again says so and trains nothing
            "fsdp2_dcp.py", 2, "--address", service.address, *args, "--checkpoint-dir", tmp_path / "b"
        )
    assert "resumed at step 9" in again.stdout and "nothing to train" in again.stdout
    assert "loss" not in again.stdout
    uninterrupted, resumed = _records(tmp_path / "a.rec", 2), _records(tmp_path / "b.rec", 2)
    for rank in range(2):
        assert [r["step"] for r in resumed[rank]] == list(range(killed_at[rank])) + list(
            range(resume_at, 9)
        )  # from the checkpoint again
        first = {r["step"]: r for r in uninterrupted[rank]}
        for r in resumed[rank]:
            assert r["ids"] == first[r["step"]]["ids"], (rank, r["step"])  # the same batches
            assert r["loss"] == pytest.approx(first[r["step"]]["loss"], rel=1e-5), (
                rank,
                r["step"],
            )  # the same loss curve


def test_tensor_parallel_replicas_receive_identical_batches(cluster, corpus, tmp_path):
    """A 2-D mesh (dp 2 x tp 2, four processes): both tensor-parallel ranks of a data-parallel
    rank receive the same batches and train a column/row-parallel MLP on them."""
    with Service.start(_plan(corpus, 2), cluster=cluster) as service:
        _torchrun("tp_replicas.py", 4, "--address", service.address, "--steps", 3, "--record", tmp_path / "rec")
        assert service.status()["failure"] is None
    recs = _records(tmp_path / "rec", 4)
    by_place = {(r[0]["dp_rank"], r[0]["tp_rank"]): [x["digest"] for x in r] for r in recs}
    assert by_place[(0, 0)] == by_place[(0, 1)] and by_place[(1, 0)] == by_place[(1, 1)]
    assert by_place[(0, 0)] != by_place[(1, 0)]
    assert all(np.isfinite(x["loss"]) for r in recs for x in r)


def test_hf_trainer_recipe_feeds_every_rank_its_own_stream(cluster, corpus, tmp_path):
    """HF ``Trainer`` on two ranks with ``PerRankTrainerMixin``: each rank consumes its own
    stream whole (accelerate neither shards it nor dispatches rank 0's), one planned step per
    optimizer step."""
    with Service.start(_plan(corpus, 2), cluster=cluster) as service:
        _torchrun(
            "hf_trainer.py",
            2,
            "--address",
            service.address,
            "--steps",
            3,
            "--output-dir",
            tmp_path / "out",
            "--record",
            tmp_path / "rec",
        )
        acked = service.status()["acked"]
    recs = _records(tmp_path / "rec", 2)
    assert [r["step"] for r in recs[0]] == [1, 2, 3] and all(5.0 < r["loss"] < 7.0 for r in recs[0])
    assert list(acked) == [1, 1]  # each rank went through steps 0 and 1 of its own stream and holds step 2


def test_lightning_recipe_feeds_every_rank_its_own_stream(cluster, corpus, tmp_path):
    with Service.start(_plan(corpus, 2), cluster=cluster) as service:
        _torchrun("lightning_ddp.py", 2, "--address", service.address, "--steps", 3, "--record", tmp_path / "rec")
    recs = _records(tmp_path / "rec", 2)
    assert [(r["step"], r["rank"]) for r in recs[0]] == [(0, 0), (1, 0), (2, 0)]
    assert [(r["step"], r["rank"]) for r in recs[1]] == [(0, 1), (1, 1), (2, 1)]


def test_titan_shaped_loader_iterates_inputs_and_labels_and_resumes(cluster, corpus):
    """torchtitan's ``BaseDataLoader`` shape (torchtitan itself needs CUDA kernels to import):
    ``(input_dict, labels)`` per micro-batch, and a DCP-style state that resumes exactly."""
    from overlord_dask.trainer.integrations import TitanDataLoader

    with Service.start(_plan(corpus, 1), cluster=cluster) as service:
        loader = TitanDataLoader(service.address, 0, 1)
        it = iter(loader)
        inputs, labels = next(it)
        assert (
            set(inputs) == {"input", "position_ids", "cu_seqlens", "max_seqlen"}
            and labels.shape == inputs["input"].shape
        )
        next(it)  # the step's second micro-batch
        state = loader.state_dict()
        after = next(it)[0]["input"]
        loader.dataset.close()
        resumed = TitanDataLoader(service.address, 0, 1)
        resumed.load_state_dict(state)
        assert torch.equal(next(iter(resumed))[0]["input"], after)
        resumed.load_state_dict({})  # a fresh run's empty state is valid
        resumed.dataset.close()
