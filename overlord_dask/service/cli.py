"""The ``overlord`` command.

overlord demo [--dp 4 --steps 100 --data demo-data]   service + trainer processes, JSON summary
overlord serve PLAN.yaml [--workers 2 --in-process --dp N --set KEY=VALUE --scheduler-file F --host H
               --port P --dashboard-port P]             run a service, print its address and page
overlord status ADDRESS|FILE [--json] [--watch [S]]     progress, rates, lag, balance, mix, pools, snapshots
overlord update ADDRESS|FILE PLAN.yaml [--at-step N]    change the plan of a running service
overlord stop ADDRESS|FILE                              stop it cleanly (last snapshot, workers retired)
overlord validate PLAN.yaml [PLAN.yaml ...]             check plans and index their sources
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time

import numpy as np

from ..allocator import arrow_pool_from_start
from ..errors import OverlordError, PlanError, ServiceError

SERVICE_MODULES = {"pyarrow", "zarr", "pydantic", "yaml", "numba", "PIL", "prometheus_client", "tqdm", "fsspec"}
"""What the 'service' extra brings (pyproject.toml): a trainer-only install lacks them."""

_IDENTITY_FIELDS = (
    "source_ids",
    "epochs",
    "sample_ids",
    "piece_starts",
    "cu_seqlens",
)  # report.delivered_record's inputs


def _demo_trainer(address: str, rank: int, dp: int, steps: int, out: str) -> None:
    """One trainer rank of the demo: consume ``steps`` steps as a training loop would."""
    import torch

    from ..observe.figures import delivered_record
    from ..trainer.dataset import OverlordDataset

    ds = OverlordDataset(address, rank=rank, dp=dp)
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=0)
    kept, tokens = [], 0  # per step: (step, its micro-batches' identity arrays)
    digest = hashlib.sha256()  # every token this rank received, in order: equal across runs of one plan and seed
    step_end, step_tokens = [], []  # per step: when this rank finished it, and its real tokens
    current: list[dict] = []
    in_step = 0
    t_start = time.time()
    t_first = None
    for mb in loader:
        if t_first is None:
            t_first = time.time()
        # a real trainer would run forward/backward here; we only touch the tensors
        n = int(mb["num_tokens"])
        tokens += n
        digest.update(mb["input_ids"].numpy()[:n].astype("<i4").tobytes())
        in_step += n
        current.append(
            {k: mb[k].numpy() for k in _IDENTITY_FIELDS}
        )  # what exactly-once accounting reads, after the run
        if mb["last_in_step"]:
            kept.append((mb["step"], current))
            step_end.append(time.time())
            step_tokens.append(in_step)
            current, in_step = [], 0
            if mb["step"] + 1 >= steps:
                break
    ds.stream.commit()
    t_end = time.time()
    records = []
    for step, mbs in kept:  # the accounting is not the trainer's work: off the timed loop
        rec = delivered_record({"micro_batches": mbs})
        rec["step"] = np.full(len(rec["source"]), step)
        records.append(rec)
    merged = {k: np.concatenate([r[k] for r in records]) for k in records[0]} if records else {}
    # the first wait includes attaching and the service's warm-up: report it apart
    np.savez(
        out,
        wait_s=np.array(ds.stream.wait_s[1:]),
        first_wait_s=ds.stream.wait_s[0],
        tokens=tokens,
        t_start=t_start,
        t_first=t_first,
        t_end=t_end,
        step_end=np.array(step_end),
        step_tokens=np.array(step_tokens),
        digest=digest.hexdigest(),
        **merged,
    )
    ds.close()


def run_demo(
    *,
    steps: int = 100,
    dp: int | None = None,
    workers: int = 2,
    data: str = "demo-data",
    scale: float = 1.0,
    plan_path: str | None = None,
    quiet: bool = False,
) -> dict:
    """Run the service and ``dp`` trainer processes (default: 4, or the plan's) for ``steps``
    steps; return the run summary. The demo corpus is generated at ``data`` either way (the
    example plans read it)."""
    from tqdm import tqdm

    from ..observe.figures import delivered_identities, exactly_once, mix_error, percentile, planned_identities
    from .demo import generate_demo_corpus
    from .service import Service

    plan = demo_run_plan(generate_demo_corpus(data, scale=scale), plan_path, dp)
    dp = plan.topology.dp
    ctx = mp.get_context("spawn")
    with Service.start(plan, n_workers=workers) as service, tempfile.TemporaryDirectory() as tmp:
        outs = [os.path.join(tmp, f"rank{r}.npz") for r in range(dp)]
        t0 = time.perf_counter()
        procs = [
            ctx.Process(target=_demo_trainer, args=(service.address, r, dp, steps, outs[r]), daemon=True)
            for r in range(dp)
        ]
        for p in procs:
            p.start()
        with tqdm(
            total=steps, desc=f"steps (dp={dp})", unit="step", disable=quiet or not sys.stderr.isatty(), file=sys.stderr
        ) as bar:
            done, blocks_max = 0, 0
            while done < steps:
                st = service.status()
                blocks_max = max(blocks_max, st.get("block_bytes", 0))  # loaded blocks held on the workers
                if st.get("failure"):
                    raise OverlordError(f"the service failed: {st['failure']}")
                if any(p.exitcode not in (None, 0) for p in procs):
                    raise OverlordError(f"a trainer process died: exit codes {[p.exitcode for p in procs]}")
                bar.update(min(st["committed"], steps) - done)
                done = min(st["committed"], steps)
                time.sleep(0.2)  # progress at 5 Hz: each status is a scheduler RPC the run pays for
        for p in procs:
            p.join(timeout=60)
        wall = time.perf_counter() - t0
        ranks = [dict(np.load(o)) for o in outs]
        ledger = service.ledger(0, steps)
        metrics = service.metrics(0, steps)

    planned = [planned_identities(ledger[s]) for s in range(steps)]
    delivered = [delivered_identities(r) for r in ranks]
    duplicates, missing = exactly_once(planned, delivered)
    src_tokens = np.zeros(len(plan.sources))
    for r in ranks:
        np.add.at(src_tokens, r["source"], r["length"])
    weights = np.array(list(plan.declared_weights().values()))
    tokens = int(sum(int(r["tokens"]) for r in ranks))
    waits = np.concatenate([r["wait_s"] for r in ranks])
    # steady-state rate, over the steps from `s0` on: the service builds `prefetch_steps` steps
    # before the trainers attach, and those hand over at the trainers' pace, not the service's
    # (counted from the first batch, they would overstate the rate)
    s0 = steady_from(steps, plan.loading.prefetch_steps)
    stream_s = max(float(r["t_end"]) for r in ranks) - min(
        float(r["step_end"][s0 - 1] if s0 else r["t_first"]) for r in ranks
    )
    steady_tokens = int(sum(int(r["step_tokens"][s0:].sum()) for r in ranks))
    return {
        "steps": steps,
        "dp": dp,
        "micro_batches": plan.topology.micro_batches,
        "tokens_per_micro_batch": plan.topology.tokens_per_micro_batch,
        "tokens": tokens,
        "wall_s": round(wall, 3),
        "time_to_first_batch_s": round(float(np.mean([r["first_wait_s"] for r in ranks])), 3),
        "tokens_per_s": round(steady_tokens / stream_s, 1),
        "steady_from_step": s0,
        "fill": round(float(np.mean([m["fill"] for m in metrics])), 4),
        "imbalance_p50": round(percentile([m["imbalance"] for m in metrics], 50), 4),
        "imbalance_p99": round(percentile([m["imbalance"] for m in metrics], 99), 4),
        "mb_imbalance_p50": round(percentile([m["mb_imbalance"] for m in metrics], 50), 4),
        "mb_imbalance_p99": round(percentile([m["mb_imbalance"] for m in metrics], 99), 4),
        "mix_error_max": round(mix_error(src_tokens, weights), 5),
        "wait_p50_ms": round(percentile(waits, 50) * 1e3, 2),
        "wait_p99_ms": round(percentile(waits, 99) * 1e3, 2),
        "blocks_mb_max": round(blocks_max / 2**20, 1),
        "duplicates": duplicates,
        "missing": missing,
        "digest": hashlib.sha256("".join(str(r["digest"]) for r in ranks).encode()).hexdigest()[:16],
    }


def demo_run_plan(corpus, plan_path: str | None, dp: int | None):
    """The plan ``overlord demo`` runs: the demo plan on ``corpus`` (dp 4 unless given), or the
    plan at ``plan_path`` (its dp unless given)."""
    from .demo import demo_plan

    if plan_path is None:
        return demo_plan(corpus, topology={"dp": dp or 4})
    plan = _load(plan_path)
    return plan if dp is None else _with_dp(plan, dp, f"{plan_path} (--dp {dp})")


def steady_from(steps: int, prefetch_steps: int) -> int:
    """The first step of a run's steady-state window: past the first quarter of the run and past
    the steps prefetched before the trainers attached (as far as half the run allows); 0 (the
    whole run, from the first batch) for a run of one step."""
    return 0 if steps < 2 else min(steps - 1, max(1, steps // 4, min(prefetch_steps, steps // 2)))


def _load(path: str):
    from ..plan import load_plan

    return load_plan(path)


def cmd_serve(args) -> int:
    from .. import logs
    from ..protocol import write_scheduler_file
    from ..worker.allocator_setup import tune_service_process
    from .service import Service

    logs.setup(args.log_format, args.log_level)
    tune_service_process()  # this process is the service's (its scheduler, planner and indexing)
    plan = _with_settings(_load(args.plan), args.set or [], args.plan)
    if args.dp is not None:  # the trainers' world size decides, not the file
        plan = _with_dp(plan, args.dp, f"{args.plan} (--dp {args.dp})")
    with Service.start(
        plan,
        n_workers=args.workers,
        scheduler_port=args.port,
        host=args.host,
        dashboard_port=args.dashboard_port,
        in_process=args.in_process,
    ) as service:
        if args.scheduler_file:
            write_scheduler_file(
                args.scheduler_file, service.address, service.run_id, plan.topology.dp, service.dashboard
            )
        print(
            json.dumps(
                {
                    "run_id": service.run_id,
                    "address": service.address,
                    "dp": plan.topology.dp,
                    "scheduler_file": args.scheduler_file,
                    "dashboard": service.dashboard,
                }
            ),
            flush=True,
        )
        try:
            while True:
                st = service.status()
                if st.get("failure"):
                    raise ServiceError(st["failure"])
                if st.get("stop_requested"):
                    print(json.dumps({"stopped": True, "committed": st["committed"]}), flush=True)
                    return 0  # leaving the with-block writes the last snapshot and retires the workers
                time.sleep(0.5)
        except KeyboardInterrupt:
            return 0
        finally:
            if args.scheduler_file and os.path.exists(args.scheduler_file):
                os.remove(args.scheduler_file)  # a file naming a stopped service would send trainers to a dead address


def _with_settings(plan, settings: list[str], where: str):
    """``plan`` with ``--set KEY=VALUE`` overrides (``topology.tokens_per_micro_batch=1024``,
    ``loading.prefetch_steps=8``, ``sources.0.weight=0.3``: dotted keys, list items by index,
    values read as YAML), validated again with errors naming the option."""
    import yaml

    from ..plan import plan_from_dict, plan_to_dict

    if not settings:
        return plan
    d = plan_to_dict(plan)
    for setting in settings:
        key, sep, raw = setting.partition("=")
        if not sep or not key:
            raise PlanError(f"--set {setting!r}: expected KEY=VALUE (e.g. topology.tokens_per_micro_batch=1024)")
        *parents, last = key.split(".")
        node = d
        for i, part in enumerate(parents):
            try:
                node = node[int(part)] if isinstance(node, list) else node.setdefault(part, {})
            except (ValueError, IndexError):
                raise PlanError(f"--set {setting!r}: {'.'.join(parents[: i + 1])} is not in the plan") from None
            if not isinstance(node, dict | list):
                raise PlanError(f"--set {setting!r}: {'.'.join(parents[: i + 1])} is a value, not a section")
        if isinstance(node, list):
            raise PlanError(f"--set {setting!r}: {'.'.join(parents)} is a list: give an item's index first")
        node[last] = yaml.safe_load(raw)
    return plan_from_dict(d, where=f"{where} (--set {' '.join(settings)})")


def _with_dp(plan, dp: int, where: str):
    """``plan`` with ``topology.dp`` set to ``dp`` (validated again, errors naming ``where``)."""
    from ..plan import plan_from_dict, plan_to_dict

    if plan.topology.dp == dp:
        return plan
    d = plan_to_dict(plan)
    d["topology"]["dp"] = dp
    return plan_from_dict(d, where=where)


def _attach(where: str):
    from .service import Service

    return Service.attach(where)


def cmd_status(args) -> int:
    from .status_text import render

    service = _attach(args.where)
    previous = None
    try:
        while True:
            summary, now = service.summary(), time.time()
            if args.json:
                print(json.dumps({**summary, "status": service.status()}), flush=True)
            else:
                print(render(summary, previous, now), flush=True)
            previous = (now, summary)
            if args.watch is None or summary["failure"]:
                break
            if not args.json:
                print(flush=True)
            try:
                time.sleep(args.watch)
            except KeyboardInterrupt:
                break
            if service.client.status != "running":  # the scheduler closed the connection: the service is gone
                raise ServiceError("gone")
    except (ServiceError, OSError):
        if args.watch is None:
            raise
        print(json.dumps({"gone": True}), flush=True)  # watched until the service went away
        return 0
    finally:
        service.close()
    return 1 if summary["failure"] else 0


def cmd_plan_report(args) -> int:
    from .reports import plan_report, plot_report

    plan = _load(args.plan)
    steps = args.steps or plan.steps
    if steps is None:
        raise PlanError(f"{args.plan}: the plan sets no `steps`; give --steps")
    report = plan_report(plan, steps, args.sample_units)
    if args.plot:
        plot_report(report, args.plot)
    if args.json:
        print(json.dumps({k: v for k, v in report.items() if k != "curve"}), flush=True)
        return 0
    print(f"plan {report['plan']}: {steps} steps of {report['step_tokens']:,} tokens")
    print(f"{'source':<16}{'tokens':>16}{'share':>8}{'tokens/pass':>16}{'epochs':>9}")
    for s in report["sources"]:
        per_pass = ("" if s["pass_exact"] else "~") + format(s["tokens_per_pass"], ",")
        print(f"{s['source']:<16}{s['tokens']:>16,}{s['share']:>8.3f}{per_pass:>16}{s['epochs']:>9.3f}")
    for st in report["stages"]:
        print(f"stage {st['name']!r} from step {st['start_step']}")
    if args.plot:
        print(f"plot: {args.plot}")
    return 0


def cmd_preview(args) -> int:
    from .reports import preview

    plan = _load(args.plan)
    docs = preview(plan, args.source, args.n)
    for d in docs:
        if args.json:
            print(json.dumps(d), flush=True)
            continue
        extra = "".join(f", {k.replace('_', ' ')} {d[k]}" for k in ("trained_tokens", "image_tokens") if k in d)
        print(f"--- sample {d['sample_id']}: {d['tokens']} tokens{extra}")
        print(_printable(d["text"]))
        if "trained_text" in d:
            print(f"--- trained on: {_printable(d['trained_text'])}")
    return 0


def _printable(text: str) -> str:
    """``text`` safe for a terminal: control characters (what token ids the plan's tokenizer does
    not fit decode to, say) shown as escapes, not sent to the terminal."""
    return "".join(c if c.isprintable() or c in "\n\t" else repr(c)[1:-1] for c in text)


def cmd_schema(args) -> int:
    from ..plan import Plan

    schema = Plan.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "overlord-dask plan"
    print(json.dumps(schema, indent=1), flush=True)
    return 0


def cmd_update(args) -> int:
    from ..plan.versions import MUTABLE, fixed_changes

    if (args.plan is None) == (args.skip_steps is None):
        raise PlanError("overlord update: give a plan, or --skip-steps A:B (one of them)")
    skip = None
    if args.skip_steps is not None:
        try:
            a, b = (int(x) for x in args.skip_steps.split(":"))
        except ValueError:
            raise PlanError(f"--skip-steps takes two steps as A:B, got {args.skip_steps!r}") from None
        skip = (a, b)
    service = _attach(args.where)
    try:
        if skip is not None:
            first, last = service.skip_steps(*skip, reason=args.reason)
            print(json.dumps({"skipped": [first, last], "reason": args.reason}), flush=True)
            return 0
        dp = service.plan.topology.dp  # served with --dp: the running world size stays
        new = _with_settings(_load(args.plan), args.set or [], args.plan)
        new = _with_dp(new, dp, f"{args.plan} (dp {dp} of the running service)")
        fixed = fixed_changes(service.plan, new)
        if fixed:  # the service would refuse it: say which settings, and how a --set run is updated
            raise PlanError(
                f"{args.plan}: {', '.join(fixed)} differ(s) from the running plan, and an update may change only "
                f"{', '.join(MUTABLE)}"
                + ("" if args.set else "; a service started with --set needs the same --set here")
            )
        at = service.update_plan(new, at_step=args.at_step)
    finally:
        service.close()
    print(json.dumps({"updated": True, "at_step": at}), flush=True)
    return 0


def cmd_explain(args) -> int:
    kw = {"rank": args.rank, "preview": args.preview}
    if args.where.endswith((".yaml", ".yml")) and os.path.isfile(args.where):
        from .explain import explain_offline

        out = explain_offline(_load(args.where), args.step, **kw)
    else:
        service = _attach(args.where)
        try:
            out = service.explain(args.step, **kw)
        finally:
            service.close()
    if args.json:
        print(json.dumps(out), flush=True)
        return 0
    if out["skipped"]:
        first, last = out["skipped"]["steps"]
        print(
            f"step {out['step']} was skipped (steps {first}..{last}: {out['skipped']['reason']});",
            "it would have carried:",
        )
    for p in out["pieces"]:
        where = ", ".join(
            f"{k} {p[k]}" for k in ("row_group", "row", "document_in_file", "bytes", "line_in_range") if k in p
        )
        print(
            f"rank {p['rank']} mb {p['micro_batch']}  {p['source']}  {p['file']} ({where})  sample {p['sample_id']}  "
            f"tokens {p['start']}:{p['stop']} ({p['tokens']})"
        )
        if p.get("preview"):
            print(f"    {p['preview']!r}")
    return 0


def cmd_stop(args) -> int:
    """Ask the serving process to stop, then wait until it is gone: its scheduler no longer
    listens and (given a scheduler file) the file no longer names it (a stopped service removes
    it last). The wait never calls the service: a scheduler whose planner is already detached
    would log every such call."""
    from ..protocol import resolve_address

    address = resolve_address(args.where)
    service = _attach(address)
    try:
        committed = service.status()["committed"]
        service.request_stop()
    finally:
        service.close()
    file = args.where if "://" not in args.where and os.path.isfile(args.where) else None
    deadline = time.monotonic() + args.timeout
    while time.monotonic() < deadline:
        if not _listening(address) and (file is None or _named_in(file) != address):
            print(json.dumps({"stopped": True, "address": address, "committed": committed}), flush=True)
            return 0
        time.sleep(0.25)
    raise ServiceError(f"the service at {address} was asked to stop but is still there after {args.timeout:.0f}s")


def _named_in(file: str) -> str | None:
    """The address a scheduler file names now (None: gone, or being rewritten)."""
    from ..protocol import resolve_address

    try:
        return resolve_address(file) if os.path.isfile(file) else None
    except ValueError:
        return None


def _listening(address: str) -> bool:
    """Whether anything accepts TCP connections at a Dask address (``tcp://`` or ``tls://``)."""
    import socket

    from distributed.comm import parse_address, parse_host_port

    host, port = parse_host_port(parse_address(address)[1])
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


def cmd_validate(args) -> int:
    """One JSON line per plan; every plan is checked, the exit status says whether all were good."""
    from ..plan.versions import PlanVersions
    from .indexing import index_sources
    from .preflight import preflight

    failed = 0
    for path in args.plan:
        try:
            plan = _load(path)
            units = index_sources(plan)
            preflight(plan, PlanVersions(plan), units)  # what start refuses short of a cluster
        except Exception as err:  # every plan gets its line: an unexpected error too, named, not a traceback
            failed += 1
            msg = str(err) if isinstance(err, OverlordError) else f"{type(err).__name__}: {err}"
            print(f"overlord: error: {msg}", file=sys.stderr, flush=True)
            print(json.dumps({"plan": path, "ok": False, "error": msg}), flush=True)
            continue
        warnings = _layout_warnings(plan) + _shared_file_warnings(units)
        for w in warnings:
            print(f"overlord: warning: {w}", file=sys.stderr, flush=True)
        print(
            json.dumps(
                {
                    "plan": path,
                    "name": plan.name,
                    "ok": True,
                    "sources": {k: _counts(v) for k, v in units.items()},
                    "warnings": warnings,
                }
            ),
            flush=True,
        )
    return 2 if failed else 0


def _counts(units) -> dict:
    """A source's units and documents (None where the format counts them only when loading:
    jsonl byte ranges, webdataset shards)."""
    counts = [u.n_docs for u in units]
    return {"units": len(units), "documents": None if None in counts else sum(counts)}


def _layout_warnings(plan) -> list[str]:
    """Sources whose storage layout makes loading slower than it needs to be (the plan is valid)."""
    from ..sources import layout_warnings

    return [w for src in plan.sources for w in layout_warnings(src, plan)]


def _shared_file_warnings(units: dict) -> list[str]:
    """Sources that read the same files (a copied source block, most often): each of their
    documents is delivered once per source. Valid (a deliberate upsampling), so a warning."""
    files = {name: {u.path for u in us} for name, us in units.items()}
    names = list(files)
    out = []
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            common = files[a] & files[b]
            if common:
                out.append(
                    f"sources {a!r} and {b!r} read {len(common)} of the same files (e.g. {sorted(common)[0]}): "
                    "their documents are delivered once per source"
                )
    return out


class _ShowDefaults(argparse.HelpFormatter):
    """Help that shows each option's default, unless its text already says it or there is none."""

    def _get_help_string(self, action):
        text = action.help or ""
        d = action.default
        if (
            "default" in text
            or d is None
            or d is False
            or d == ""
            or d == argparse.SUPPRESS
            or not action.option_strings
        ):
            return text
        return f"{text} (default: %(default)s)"


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def _non_negative(text: str) -> int:
    n = _positive(text) if text.strip() != "0" else 0
    return n


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    arrow_pool_from_start()  # before anything imports pyarrow: Arrow picks its allocator then (allocator.py)
    if argv[:1] == ["slurm"]:  # its own parser (slurm_job.py): also run as cluster/slurm.py
        from .slurm_job import main as slurm_main

        try:
            return slurm_main(argv[1:])
        except OverlordError as err:
            print(f"overlord: error: {err}", file=sys.stderr)
            return 2
    args = parser().parse_args(argv)
    return _run(args)


def parser() -> argparse.ArgumentParser:
    """The ``overlord`` command's options (``overlord slurm`` has its own: ``slurm_job.parser``)."""
    ap = argparse.ArgumentParser(
        prog="overlord", description="overlord-dask: a Dask data-loading service for LLM training"
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    add_parser = sub.add_parser

    def command(name: str, **kwargs):  # every command's help shows its options' defaults
        return add_parser(name, formatter_class=_ShowDefaults, **kwargs)

    sub.add_parser(
        "slurm",
        help="run the service as a Slurm job with Slurm worker jobs (see `overlord slurm --help`)",
        add_help=False,
    )
    d = command("demo", help="run the service on an embedded LocalCluster with generated data and dp trainer processes")
    d.add_argument(
        "--dp", type=_positive, default=None, help="trainer ranks, separate processes (default: 4, or the plan's)"
    )
    d.add_argument("--steps", type=_positive, default=100, help="steps every rank consumes")
    d.add_argument("--workers", type=_positive, default=2, help="Dask worker processes")
    d.add_argument("--data", default="demo-data", help="demo corpus folder (generated when missing)")
    d.add_argument("--scale", type=float, default=1.0, help="demo corpus size multiplier")
    d.add_argument("--plan", default=None, help="a plan to run instead of the demo plan (its sources, its topology)")
    d.add_argument("--quiet", action="store_true", help="no progress bar")
    s = command("serve", help="run a service for a plan and print its address")
    s.add_argument("plan")
    s.add_argument(
        "--workers", type=_non_negative, default=2, help="embedded worker processes (0: workers join from other hosts)"
    )
    s.add_argument(
        "--in-process",
        action="store_true",
        help="run the embedded workers as threads of the service's process: one process, the least memory "
        "(a single node with a few ranks; a Python tokenizer or prepare step then shares the scheduler's GIL; "
        "no shadow copies and no Dask Bokeh pages, the /overlord page is served)",
    )
    s.add_argument(
        "--port", type=int, default=0, help="scheduler port (fixed, so that trainers reconnect to a restarted service)"
    )
    s.add_argument("--host", default=None, help="interface the scheduler listens on (default: loopback only)")
    s.add_argument("--dp", type=_positive, default=None, help="data-parallel ranks (overrides the plan's topology.dp)")
    s.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        help="override a plan setting, e.g. --set topology.tokens_per_micro_batch=1024 (repeatable)",
    )
    s.add_argument(
        "--dashboard-port",
        type=_non_negative,
        default=0,
        help="port of the dashboard with the /overlord page (0: a free one; the URL is printed, "
        "written to the scheduler file and shown by `overlord status`)",
    )
    s.add_argument(
        "--scheduler-file", default=None, help="write the address here (trainers and tools can be given the file)"
    )
    s.add_argument(
        "--log-format",
        choices=["logfmt", "json"],
        default="logfmt",
        help="the service's event log on stderr (and its workers')",
    )
    s.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="log level")
    st = command("status", help="a running service's progress, lag, balance, mix, pools and snapshots")
    st.add_argument("where", help="scheduler address or scheduler file")
    st.add_argument("--json", action="store_true", help="JSON instead of text")
    st.add_argument(
        "--watch",
        type=float,
        nargs="?",
        const=5.0,
        default=None,
        metavar="SECONDS",
        help="print it again every SECONDS (default 5) until interrupted or the service is gone",
    )
    pr = command("plan-report", help="tokens and epochs per source up to a step, stage boundaries (no cluster)")
    pr.add_argument("plan")
    pr.add_argument("--steps", type=_positive, default=None, help="up to this step (default: the plan's steps)")
    pr.add_argument(
        "--sample-units", type=_positive, default=2, help="units read per source to measure its tokens per pass"
    )
    pr.add_argument(
        "--plot", default=None, help="write a plot of cumulative tokens per source to this file (png, svg, pdf)"
    )
    pr.add_argument("--json", action="store_true", help="JSON instead of text")
    pv = command("preview", help="a source's first documents decoded, as trainers receive them (no cluster)")
    pv.add_argument("plan")
    pv.add_argument("--source", required=True, help="the source's name in the plan")
    pv.add_argument("-n", type=_positive, default=5, help="documents shown")
    pv.add_argument("--json", action="store_true", help="JSON instead of text")
    command("schema", help="the JSON Schema of a plan (for editors and validators)")
    u = command("update", help="change a running service's plan from a step on, or skip steps")
    u.add_argument("where", help="scheduler address or scheduler file")
    u.add_argument("plan", nargs="?", default=None, help="the new plan (YAML)")
    u.add_argument(
        "--at-step", type=int, default=None, help="first step of the new plan (default: the first not planned yet)"
    )
    u.add_argument(
        "--skip-steps",
        default=None,
        metavar="A:B",
        help="do not hand out steps A to B (inclusive): a job restarted from its checkpoint at A goes on at B + 1",
    )
    u.add_argument("--reason", default="", help="why the steps are skipped (recorded with the skip)")
    u.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        help="override a setting of the new plan, as `overlord serve --set` (repeatable)",
    )
    ex = command("explain", help="which documents each rank trained on at a step (file, row, tokens, text)")
    ex.add_argument(
        "where", help="a running service (scheduler address or file) or a plan YAML (offline: its snapshots)"
    )
    ex.add_argument("--step", type=int, required=True, help="the global step")
    ex.add_argument("--rank", type=int, default=None, help="one data-parallel rank (default: every rank)")
    ex.add_argument("--preview", type=int, default=160, help="characters of text per piece (0: none, no file read)")
    ex.add_argument("--json", action="store_true", help="JSON instead of text")
    sp = command("stop", help="stop a running service cleanly (last snapshot written, workers retired)")
    sp.add_argument("where", help="scheduler address or scheduler file")
    sp.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the service to exit")
    v = command("validate", help="validate a plan and index its sources")
    v.add_argument("plan", nargs="+")
    return ap


def _run(args) -> int:
    try:
        if args.cmd == "demo":
            summary = run_demo(
                steps=args.steps,
                dp=args.dp,
                workers=args.workers,
                data=args.data,
                scale=args.scale,
                plan_path=args.plan,
                quiet=args.quiet,
            )
            print(json.dumps(summary), flush=True)
            return 0
        commands = {
            "serve": cmd_serve,
            "status": cmd_status,
            "update": cmd_update,
            "explain": cmd_explain,
            "stop": cmd_stop,
            "validate": cmd_validate,
            "plan-report": cmd_plan_report,
            "preview": cmd_preview,
            "schema": cmd_schema,
        }
        return commands[args.cmd](args)
    except OverlordError as err:
        print(f"overlord: error: {err}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as err:
        if err.name and err.name.split(".")[0] in SERVICE_MODULES:  # a trainer-only install
            print(
                f"overlord: error: the service needs the 'service' extra: pip install 'overlord-dask[service]' "
                f"(missing: {err.name})",
                file=sys.stderr,
            )
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
