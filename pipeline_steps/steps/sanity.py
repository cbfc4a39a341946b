"""sanity: device, collective and host health checks, run before spending trn1 hours.

Writes DIR/sanity/rank-<r>.json (every rank) and DIR/sanity/sanity.json (rank 0: status, failed
ranks and why). Exit 75 (retried) for a failed check, a failed process-group join or a run past
--timeout-s; 78 for an INSTANCE_TYPE outside the instance table, --iterations or --expect-world-size
below 1, or a bad PIPELINE_SANITY_FAULT_RANK. What it checks: docs/infrastructure.md.

Local:  torchrun --standalone --nproc_per_node 2 -m pipeline_steps sanity --run-dir runs/demo --backend cpu
AWS:    torchrun $TORCHRUN_ARGS -m pipeline_steps sanity --run-dir /fsx/runs/<run_id> --fsx-path /fsx
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from pipeline_contract import INSTANCE_TYPE_ENV, INSTANCE_TYPES, NPROC_PER_NODE_ENV

from .. import distributed, tracking
from ..collective_checks import (
    COLLECTIVE_CHECKS,
    FAULT_RANK_ENV,
    check_all_gather,
    check_all_reduce,
    check_matmul,
    check_reduce_scatter,
    fault_rank,
)
from ..errors import BadConfigError, ExitCode, RetryableError
from ..fileio import atomic_write_json
from ..health_report import FAILED, PASSED, SKIPPED, Check, Report, summary
from ..host_checks import run_on_node
from ..watchdog import Watchdog

log = logging.getLogger("pipeline_steps.sanity")


def expected_world_size(flag: int | None, environ: Mapping[str, str]) -> tuple[int, str]:
    """The world size a healthy launch must have, and where that number came from."""
    if flag is not None:
        return flag, "--expect-world-size"
    nodes, nproc = environ.get("AWS_BATCH_JOB_NUM_NODES"), environ.get(NPROC_PER_NODE_ENV)
    if nodes and nproc:
        return int(nodes) * int(nproc), f"AWS_BATCH_JOB_NUM_NODES x {NPROC_PER_NODE_ENV}"
    if environ.get("WORLD_SIZE"):
        return int(environ["WORLD_SIZE"]), "WORLD_SIZE (torchrun)"
    return 1, "single process (no torchrun, no AWS Batch multi-node variables)"


def expected_instance_type(flag: str | None, environ: Mapping[str, str]) -> str | None:
    """The instance type whose device counts this host must show: --instance-type, else
    $INSTANCE_TYPE (the job definitions set it from the instance table), else None (counts unknown:
    device checks only look for presence)."""
    name = flag or environ.get(INSTANCE_TYPE_ENV, "").strip() or None
    if name is not None and name not in INSTANCE_TYPES:
        raise BadConfigError(f"{INSTANCE_TYPE_ENV}={name!r} is not in the instance table {sorted(INSTANCE_TYPES)}; "
                             "set it to this host's instance type, or unset it off AWS")
    return name


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pipeline_steps sanity", description=__doc__.split("\n")[0])
    p.add_argument("--run-dir", required=True, type=Path)
    p.add_argument("--backend", choices=distributed.BACKENDS, default=None,
                   help="default: xla on a Neuron host, cuda with a GPU, else cpu")
    p.add_argument("--expect-world-size", type=int, default=None,
                   help="default: AWS_BATCH_JOB_NUM_NODES x NPROC_PER_NODE, else torchrun's WORLD_SIZE")
    p.add_argument("--instance-type", default=None, choices=sorted(INSTANCE_TYPES),
                   help=f"expected Neuron device/core and EFA counts come from this row of the instance table; "
                        f"default: env {INSTANCE_TYPE_ENV} (every job definition sets it)")
    p.add_argument("--fsx-path", default=None, help="FSx for Lustre mount to check (e.g. /fsx)")
    p.add_argument("--bandwidth-floor-gbps", type=float, default=None,
                   help="minimum nccom-test all-reduce bus bandwidth in GB/s as nccom-test prints it")
    p.add_argument("--iterations", type=int, default=5, help="repetitions of each device/collective check")
    p.add_argument("--timeout-s", type=float, default=900.0,
                   help="wall-clock bound of the whole run; on expiry exit 75 (includes first XLA compiles)")
    return p


def _parsed(argv: list[str] | None) -> argparse.Namespace:
    args = _parser().parse_args(argv)
    if args.iterations < 1:
        raise BadConfigError("--iterations must be >= 1")
    if args.expect_world_size is not None and args.expect_world_size < 1:
        raise BadConfigError("--expect-world-size must be >= 1")
    args.instance_type = expected_instance_type(args.instance_type, os.environ)
    args.backend = args.backend or distributed.default_backend()
    return args


class _RankFile:
    """This rank's rank-<r>.json: its report plus what it expected (written after the checks, and by
    the watchdog on a stall)."""

    def __init__(self, out_dir: Path, report: Report, extra: dict[str, Any]) -> None:
        self.path, self.report, self.extra = out_dir / f"rank-{report.rank}.json", report, extra

    def write(self) -> None:
        atomic_write_json(self.path, {**self.report.to_dict(), **self.extra, "versions": distributed.versions()})


def _expectations(args: argparse.Namespace, faulty: int | None) -> dict[str, Any]:
    expected_ws, ws_source = expected_world_size(args.expect_world_size, os.environ)
    extra: dict[str, Any] = {"expected_world_size": expected_ws, "expected_world_size_source": ws_source,
                             "instance_type": args.instance_type, "fault_injection": None}
    if faulty is not None:
        log.warning("FAULT INJECTION ACTIVE: %s=%d makes rank %d contribute a wrong all_reduce value "
                    "(testing the detection path; unset it for real runs)", FAULT_RANK_ENV, faulty, faulty)
        extra["fault_injection"] = {"env": FAULT_RANK_ENV, "rank": faulty}
    return extra


def _join(report: Report, rank_file: _RankFile) -> distributed.World:
    report.current = "process_group (joining the group, initialising the device)"
    try:
        world = distributed.init(report.backend)
    except RetryableError as exc:
        report.checks.append(Check("process_group", FAILED, expected="joined", actual="failed", detail=str(exc)))
        rank_file.write()
        raise
    report.current = None
    report.world_size = world.world_size
    return world


def _device_checks(world: distributed.World, report: Report, extra: dict[str, Any], args: argparse.Namespace,
                   faulty: int | None) -> None:
    expected_ws, ws_source = extra["expected_world_size"], extra["expected_world_size_source"]
    report.run("world_size", lambda: Check(
        "world_size", PASSED if world.world_size == expected_ws else FAILED,
        expected_ws, world.world_size, detail=f"expected from {ws_source}"))
    report.run("device_matmul", lambda: check_matmul(world, args.iterations))
    report.run("all_reduce", lambda: check_all_reduce(world, args.iterations, faulty))
    report.run("all_gather", lambda: check_all_gather(world, args.iterations))
    report.run("reduce_scatter", lambda: check_reduce_scatter(world, args.iterations))


def _failed_ranks(world: distributed.World, report: Report) -> list[int] | None:
    """Every rank learns which ranks failed (rank 0 reports them): one more collective, only when
    every collective completed (right or wrong values); after one raised (a peer died, a link broke)
    it would just wait for the watchdog. None: not asked."""
    if report.raised & set(COLLECTIVE_CHECKS):
        return None
    flags = distributed.to_cpu(distributed.all_gather(
        world, torch.tensor([float(len(report.failed))]).to(world.device)))
    return [r for r, n in enumerate(flags.tolist()) if n > 0]


def _verdict(report: Report, failed_ranks: list[int] | None, world_size: int, out_dir: Path) -> int:
    problems = report.failed
    if problems or failed_ranks:
        lines = [f"  {c.name}: expected {c.expected}, actual {c.actual}" + (f" ({c.detail})" if c.detail else "")
                 for c in problems]
        others = [r for r in (failed_ranks or []) if r != report.rank]
        if others:
            lines.append(f"  checks also failed on ranks {others} (see {out_dir}/rank-<r>.json)")
        raise RetryableError(f"sanity failed on rank {report.rank} of {world_size}:\n" + "\n".join(lines)
                             + f"\nresults: {out_dir}")
    log.info("sanity passed: %d checks on %d rank(s), %d skipped; results in %s", len(report.checks),
             world_size, sum(c.status == SKIPPED for c in report.checks), out_dir)
    return ExitCode.OK


def main(argv: list[str] | None = None) -> int:
    args = _parsed(argv)
    faulty = fault_rank(os.environ)
    out_dir = args.run_dir / "sanity"
    out_dir.mkdir(parents=True, exist_ok=True)
    report = Report(rank=int(os.environ.get("RANK", "0")), local_rank=int(os.environ.get("LOCAL_RANK", "0")),
                    world_size=int(os.environ.get("WORLD_SIZE", "1")), backend=args.backend)
    extra = _expectations(args, faulty)
    rank_file = _RankFile(out_dir, report, extra)

    def on_stall(message: str) -> None:
        report.checks.append(Check("timeout", FAILED, expected=f"finish within {args.timeout_s:g} s",
                                   actual=f"still running check {report.current or '(between checks)'}",
                                   detail=message))
        rank_file.write()

    started = time.monotonic()
    with Watchdog(args.timeout_s, what="sanity run", on_stall=on_stall):
        run_on_node(report, instance_type=args.instance_type, fsx_path=args.fsx_path,
                    bandwidth_floor=args.bandwidth_floor_gbps, iterations=args.iterations,
                    deadline=started + args.timeout_s)
        world = _join(report, rank_file)
        _device_checks(world, report, extra, args, faulty)
        rank_file.write()
        failed_ranks = _failed_ranks(world, report)
        if world.is_main:
            result = summary(report, extra, failed_ranks, out_dir, time.monotonic() - started)
            atomic_write_json(out_dir / "sanity.json", result)
            # tracking: this step as a child run of the pipeline's MLflow run (never fails the step)
            tracking.log_step("sanity", args.run_dir, params={"backend": args.backend},
                              metrics=tracking.flatten(result))
        if failed_ranks is not None:
            # Keep every rank alive until rank 0 has written sanity.json: torchrun stops the
            # whole group as soon as one rank exits non-zero.
            distributed.barrier(world)
        distributed.shutdown()
    return _verdict(report, failed_ranks, world.world_size, out_dir)
