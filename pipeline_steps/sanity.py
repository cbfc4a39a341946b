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
import json
import logging
import os
import re
import secrets
import shutil
import socket
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from . import distributed, tracking
from .contract import INSTANCE_TYPE_ENV, INSTANCE_TYPES, NPROC_PER_NODE_ENV, InstanceSpec
from .errors import BadConfigError, ExitCode, RetryableError
from .fileio import atomic_write_json, read_json
from .watchdog import Watchdog

log = logging.getLogger(__name__)

PASSED, FAILED, SKIPPED = "passed", "failed", "skipped"
# PIPELINE_SANITY_FAULT_RANK=<r>: rank r contributes a wrong all_reduce value (tests the detection path).
FAULT_RANK_ENV = "PIPELINE_SANITY_FAULT_RANK"


# Payload sizes (elements of fp32). Values are built so every partial sum is an integer below 2**24:
# exact in fp32 in any reduction order, so results compare exactly.
MATMUL_N = 128
ALL_REDUCE_NUMEL = 1 << 18  # 1 MiB: enough to time, small enough for gloo on a laptop
ALL_GATHER_NUMEL = 1024  # per rank
REDUCE_SCATTER_NUMEL = 1024  # per rank (the input is world_size times this)
TOOL_TIMEOUT_S = 120.0
NCCOM_TIMEOUT_S = 600.0
PROBE_BYTES = 1 << 20
ROOT_COMM_ENV = "NEURON_RT_ROOT_COMM_ID"  # the collectives' bootstrap address (training_image/entrypoint.sh)
INFINIBAND_DIR = Path("/dev/infiniband")  # where the job definition maps the EFA uverbs devices
NEURON_DEV_DIR = Path("/dev")  # /dev/neuron0..N-1, also mapped by the job definition


# ----------------------------------------------------------------------------- results

@dataclass
class Check:
    name: str
    status: str
    expected: Any = None
    actual: Any = None
    seconds: float = 0.0
    detail: str = ""

    def line(self) -> str:
        text = f"{self.status.upper():<7} {self.name:<18} {self.seconds * 1000:9.1f} ms"
        if self.status == FAILED:
            text += f"  expected {self.expected}, actual {self.actual}"
        return text + (f"  ({self.detail})" if self.detail else "")


@dataclass
class Report:
    rank: int
    local_rank: int
    world_size: int
    backend: str
    host: str = field(default_factory=socket.gethostname)
    started_at: str = field(default_factory=lambda: datetime.now(timezone.utc).isoformat(timespec="seconds"))
    checks: list[Check] = field(default_factory=list)
    current: str | None = None  # the check in progress, for the watchdog's report
    raised: set[str] = field(default_factory=set)  # checks that ended in an exception, not a wrong value

    def run(self, name: str, fn: Callable[[], Check]) -> Check:
        """Run one check, time it, and record an exception from the device or a collective as a
        failure of that check (the next checks still run and show how far the damage goes)."""
        self.current = name
        start = time.perf_counter()
        try:
            check = fn()
        except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
            check = Check(name, FAILED, expected="completes", actual="raised", detail=f"{type(exc).__name__}: {exc}")
            self.raised.add(name)
        check.seconds = round(time.perf_counter() - start, 6)
        self.checks.append(check)
        self.current = None
        (log.error if check.status == FAILED else log.info)("%s", check.line())
        return check

    def skip(self, name: str, reason: str) -> Check:
        return self.run(name, lambda: Check(name, SKIPPED, detail=reason))

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.checks if c.status == FAILED]

    def to_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank, "local_rank": self.local_rank, "world_size": self.world_size,
            "backend": self.backend, "host": self.host, "started_at": self.started_at,
            "status": FAILED if self.failed else PASSED,
            "checks": [asdict(c) for c in self.checks],
        }


# ----------------------------------------------------------------------------- pure helpers

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


def fault_rank(environ: Mapping[str, str]) -> int | None:
    value = environ.get(FAULT_RANK_ENV, "").strip()
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise BadConfigError(f"{FAULT_RANK_ENV}={value!r} is not a rank number; unset it") from None


def rank_weight(rank: int) -> int:
    """a(r) = r % 7 + 1: small and rank-dependent, so sums stay exact and a missing or swapped
    contribution changes the result."""
    return rank % 7 + 1


def sum_rank_weights(world_size: int) -> int:
    """S(W) = sum of a(r) for r < W, in closed form (1+..+7 = 28 per full cycle of 7 ranks)."""
    cycles, rest = divmod(world_size, 7)
    return 28 * cycles + rest * (rest + 1) // 2


def compare(expected: torch.Tensor, actual: torch.Tensor, *, atol: float = 0.0, rtol: float = 0.0,
            show: int = 4) -> tuple[bool, str, str, str]:
    """(ok, expected, actual, detail) with the values shown from the first mismatching index."""
    actual = actual.detach().to("cpu", torch.float64).reshape(-1)
    expected = expected.detach().to("cpu", torch.float64).reshape(-1)
    if actual.shape != expected.shape:
        return False, f"shape {list(expected.shape)}", f"shape {list(actual.shape)}", "wrong shape"
    bad = ~((actual - expected).abs() <= atol + rtol * expected.abs())  # NaN counts as bad
    num_bad = int(bad.sum())
    first = int(bad.nonzero()[0, 0]) if num_bad else 0

    def window(t: torch.Tensor) -> str:
        values = ", ".join(f"{v:g}" for v in t[first:first + show].tolist())
        return f"x[{first}:{first + show}]=[{values}]"

    detail = f"{num_bad} of {expected.numel()} elements differ" if num_bad else ""
    return num_bad == 0, window(expected), window(actual), detail


def mount_of(path: str, mounts_text: str) -> tuple[str, str] | None:
    """(mount point, fs type) of the longest mount point containing `path`, from /proc/mounts text."""
    best: tuple[str, str] | None = None
    for line in mounts_text.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        # /proc/mounts escapes blanks in paths as octal (\040 = space).
        mount_point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[1])
        inside = path == mount_point or path.startswith(mount_point.rstrip("/") + "/")
        if inside and (best is None or len(mount_point) >= len(best[0])):
            best = (mount_point, fields[2])
    return best


_NCCOM_ROW = re.compile(r"^\s*(\d+)\s+(\d+)\s+(\w+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s*$")
_NCCOM_AVG = re.compile(r"Avg bus bandwidth:\s*([\d.]+)\s*GB/s")


def parse_nccom_output(text: str) -> dict[str, Any]:
    """Rows of nccom-test's table ({size_bytes, time_us, algbw, busbw} in GB/s as it prints them,
    which the Neuron docs define as GiB/s), its average bus bandwidth, and whether it reported errors."""
    rows = []
    for line in text.splitlines():
        match = _NCCOM_ROW.match(line)
        if match:
            rows.append({"size_bytes": int(match[1]), "type": match[3], "time_us": float(match[4]),
                         "algbw": float(match[5]), "busbw": float(match[6])})
    avg = _NCCOM_AVG.search(text)
    errors = bool(re.search(r"errors? found|test failed|Failure", text, re.IGNORECASE))
    return {"rows": rows, "avg_busbw": float(avg[1]) if avg else None, "errors": errors}


def _tail(text: str, lines: int = 5) -> str:
    return " | ".join(text.strip().splitlines()[-lines:])


# ----------------------------------------------------------------------------- host checks (per node)

class HostChecks:
    """Checks of the machine rather than of a process; run once per node by local rank 0."""

    def __init__(self, report: Report, spec: InstanceSpec | None, instance_type: str | None,
                 fsx_path: str | None, bandwidth_floor: float | None, iterations: int,
                 deadline: float) -> None:
        self.report, self.spec, self.instance_type = report, spec, instance_type
        self.fsx_path, self.bandwidth_floor, self.iterations = fsx_path, bandwidth_floor, iterations
        self.deadline = deadline

    def _timeout(self, cap: float) -> float:
        return max(1.0, min(cap, self.deadline - time.monotonic()))

    def _run_tool(self, argv: list[str], cap: float,
                  env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(argv, capture_output=True, text=True, timeout=self._timeout(cap), check=False,
                              env=None if env is None else dict(env))

    def run_all(self) -> None:
        r = self.report
        r.run("neuron_devices", self.neuron_devices)
        r.run("efa_devices", self.efa_devices)
        r.run("efa_provider", self.efa_provider)
        r.run("fsx_mount", self.fsx_mount)
        r.run("fsx_writable", self.fsx_writable)
        r.run("nccom_all_reduce", self.nccom_all_reduce)

    def neuron_devices(self) -> Check:
        name, tool = "neuron_devices", shutil.which("neuron-ls")
        if tool is None:
            if self.spec is None:
                return Check(name, SKIPPED, detail="neuron-ls not on PATH (not a Neuron host)")
            # The instance type promises devices: count the device files the job definition maps.
            found = len(list(NEURON_DEV_DIR.glob("neuron[0-9]*")))
            expected = self.spec.neuron_devices
            detail = f"instance type {self.instance_type}; counted {NEURON_DEV_DIR}/neuron* (neuron-ls not on PATH)"
            if found < expected:
                detail += "; missing Neuron devices: not a Neuron host, or not mapped into the container"
            return Check(name, PASSED if found == expected else FAILED, expected={"devices": expected},
                         actual={"devices": found}, detail=detail)
        proc = self._run_tool([tool, "--json-output"], TOOL_TIMEOUT_S)
        if proc.returncode != 0:
            return Check(name, FAILED, expected="neuron-ls exit 0", actual=f"exit {proc.returncode}",
                         detail=_tail(proc.stderr or proc.stdout))
        try:
            devices = json.loads(proc.stdout)
            actual = {"devices": len(devices), "cores": sum(int(d["nc_count"]) for d in devices)}
        except (ValueError, KeyError, TypeError) as exc:
            return Check(name, FAILED, expected="neuron-ls JSON list of devices with nc_count",
                         actual=_tail(proc.stdout, 2), detail=f"unparseable output: {exc}")
        if self.spec is None:
            ok = actual["devices"] > 0
            return Check(name, PASSED if ok else FAILED, expected="at least 1 device", actual=actual,
                         detail="no --instance-type: only checked that devices exist")
        expected = {"devices": self.spec.neuron_devices, "cores": self.spec.neuron_cores}
        return Check(name, PASSED if actual == expected else FAILED, expected=expected, actual=actual,
                     detail=f"instance type {self.instance_type}")

    def efa_devices(self) -> Check:
        name = "efa_devices"
        found = len(list(INFINIBAND_DIR.glob("uverbs*")))
        if self.spec is None:
            return Check(name, SKIPPED, actual=found,
                         detail="no --instance-type: no expected EFA count to compare against")
        ok = found == self.spec.efa_interfaces
        detail = f"instance type {self.instance_type}; counted {INFINIBAND_DIR}/uverbs*"
        if not ok and found < self.spec.efa_interfaces:
            detail += "; missing EFA devices: is every uverbs device mapped into the container by the job definition?"
        return Check(name, PASSED if ok else FAILED, expected=self.spec.efa_interfaces, actual=found, detail=detail)

    def efa_provider(self) -> Check:
        name = "efa_provider"
        if self.spec is not None and self.spec.efa_interfaces == 0:
            return Check(name, SKIPPED, detail=f"{self.instance_type} has no EFA")
        if self.spec is None and not INFINIBAND_DIR.exists():
            return Check(name, SKIPPED, detail="no --instance-type and no /dev/infiniband (not an EFA host)")
        tool = shutil.which("fi_info")
        if tool is None:
            return Check(name, SKIPPED, detail="fi_info not on PATH (libfabric tools not installed)")
        proc = self._run_tool([tool, "-p", "efa"], TOOL_TIMEOUT_S)
        providers = len(re.findall(r"provider:\s*efa", proc.stdout))
        ok = proc.returncode == 0 and providers > 0
        return Check(name, PASSED if ok else FAILED, expected="exit 0 with >= 1 efa provider",
                     actual=f"exit {proc.returncode}, {providers} efa providers",
                     detail="" if ok else _tail(proc.stderr or proc.stdout))

    def fsx_mount(self) -> Check:
        name = "fsx_mount"
        if self.fsx_path is None:
            return Check(name, SKIPPED, detail="no --fsx-path given")
        try:
            mounts = Path("/proc/mounts").read_text(encoding="utf-8", errors="replace")
        except OSError as exc:
            return Check(name, SKIPPED, detail=f"cannot read /proc/mounts ({exc}); not Linux?")
        found = mount_of(os.path.realpath(self.fsx_path), mounts)
        actual = f"{found[1]} at {found[0]}" if found else "not mounted"
        ok = found is not None and found[1] == "lustre"
        return Check(name, PASSED if ok else FAILED, expected=f"lustre at or above {self.fsx_path}",
                     actual=actual, detail="" if ok else "FSx for Lustre is not mounted there (user data / host volume?)")

    def fsx_writable(self) -> Check:
        name = "fsx_writable"
        if self.fsx_path is None:
            return Check(name, SKIPPED, detail="no --fsx-path given")
        root = Path(self.fsx_path)
        if not root.is_dir():
            return Check(name, FAILED, expected=f"directory {root}", actual="missing")
        probe = root / f".sanity-probe-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
        payload = secrets.token_bytes(PROBE_BYTES)
        start = time.perf_counter()
        try:
            with open(probe, "wb") as fh:
                fh.write(payload)
                fh.flush()
                os.fsync(fh.fileno())
            read_back = probe.read_bytes()
        finally:
            probe.unlink(missing_ok=True)
        seconds = time.perf_counter() - start
        ok = read_back == payload
        return Check(name, PASSED if ok else FAILED, expected=f"{PROBE_BYTES} bytes read back intact",
                     actual=f"{len(read_back)} bytes, {'intact' if ok else 'CORRUPTED'}",
                     detail=f"write+fsync+read+delete {PROBE_BYTES >> 20} MiB in {seconds * 1000:.0f} ms")

    def nccom_all_reduce(self) -> Check:
        name, tool = "nccom_all_reduce", shutil.which("nccom-test")
        if tool is None:
            return Check(name, SKIPPED, detail="nccom-test not on PATH (aws-neuronx-tools not installed)")
        cores = self.spec.neuron_cores if self.spec else int(os.environ.get("LOCAL_WORLD_SIZE", "2"))
        # --check verifies values and works only with fp32; 32 MiB is the tool's default size.
        argv = [tool, "-r", str(cores), "-b", "32M", "-e", "32M", "-d", "fp32",
                "-n", str(max(self.iterations, 5)), "--check", "allr"]
        proc = self._run_tool(argv, NCCOM_TIMEOUT_S, env={**os.environ, ROOT_COMM_ENV: own_root_comm_id()})
        parsed = parse_nccom_output(proc.stdout + "\n" + proc.stderr)
        if proc.returncode != 0 or parsed["errors"] or not parsed["rows"]:
            return Check(name, FAILED, expected="exit 0, correctness check passed",
                         actual=f"exit {proc.returncode}, {len(parsed['rows'])} result rows",
                         detail=f"{' '.join(argv)}: {_tail(proc.stdout + proc.stderr)}")
        busbw = min(row["busbw"] for row in parsed["rows"])
        actual = f"{busbw:g} GB/s bus bandwidth, check passed"
        if self.bandwidth_floor is None:
            return Check(name, PASSED, expected="correctness check passed", actual=actual,
                         detail=f"{cores} ranks; no --bandwidth-floor-gbps given")
        ok = busbw >= self.bandwidth_floor
        return Check(name, PASSED if ok else FAILED, expected=f">= {self.bandwidth_floor:g} GB/s bus bandwidth",
                     actual=actual, detail=f"{cores} ranks, 32 MiB fp32 all-reduce")


def own_root_comm_id() -> str:
    """Where a one-node nccom-test bootstraps its ranks: this host, on a free port. The entrypoint
    exports the main node's address in NEURON_RT_ROOT_COMM_ID for training; inherited, it would
    send every node's test to the main node. The nccom-test guide sets the variable to the address
    of the instance the test runs on, and only for multi-node runs
    (https://awsdocs-neuron.readthedocs-hosted.com/en/latest/tools/neuron-sys-tools/nccom-test.html)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{probe.getsockname()[1]}"


HOST_CHECKS = ("neuron_devices", "efa_devices", "efa_provider", "fsx_mount", "fsx_writable", "nccom_all_reduce")


def _node_store(timeout_s: float) -> Any:
    """A client of torchrun's rendezvous store (MASTER_ADDR:MASTER_PORT), usable before the process
    group exists: the node's local ranks wait on it while local rank 0 runs the host checks."""
    import torch.distributed as dist

    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=timedelta(seconds=max(1.0, timeout_s)))


# ----------------------------------------------------------------------------- device and collectives

def _timed(world: distributed.World, iterations: int, op: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, list[float]]:
    """Run `op` `iterations` times, each time through to a CPU tensor (which waits for the device
    and, on XLA, compiles and runs the graph); returns every result's CPU copy and per-run seconds."""
    results, seconds = [], []
    for _ in range(iterations):
        start = time.perf_counter()
        out = op()
        distributed.mark_step(world)
        results.append(distributed.to_cpu(out))
        seconds.append(time.perf_counter() - start)
    return results, seconds


def _timing(seconds: list[float], payload_bytes: int | None = None) -> str:
    median = statistics.median(seconds)
    text = f"{len(seconds)} runs, median {median * 1000:.2f} ms, max {max(seconds) * 1000:.2f} ms"
    if payload_bytes:
        text += f", {payload_bytes / median / 1e9:.3f} GB/s algbw"
    return text


def _first_bad(results: list[torch.Tensor], expected: torch.Tensor) -> Check | None:
    for i, result in enumerate(results):
        ok, exp, act, detail = compare(expected, result, atol=0.5)
        if not ok:
            return Check("", FAILED, exp, act, detail=f"run {i + 1} of {len(results)}: {detail}")
    return None


def check_matmul(world: distributed.World, iterations: int) -> Check:
    # A[i,k] = i%8+1 and B[k,j] = j%8+1, so (A @ B)[i,j] = n * (i%8+1) * (j%8+1): integers <= 8192.
    n = MATMUL_N
    rows = (torch.arange(n) % 8 + 1).float()
    a = rows[:, None].expand(n, n).contiguous().to(world.device)
    b = rows[None, :].expand(n, n).contiguous().to(world.device)
    expected = n * rows[:, None] * rows[None, :]
    results, seconds = _timed(world, iterations, lambda: a @ b)
    bad = _first_bad(results, expected)
    if bad:
        bad.name = "device_matmul"
        return bad
    return Check("device_matmul", PASSED, "C[i,j] = 128*(i%8+1)*(j%8+1)", "equal",
                 detail=f"{n}x{n} fp32 on {world.device}; {_timing(seconds)}")


def check_all_reduce(world: distributed.World, iterations: int, faulty_rank: int | None) -> Check:
    # x_r[i] = a(r) * (i%13+1); the sum over ranks is S(W) * (i%13+1).
    pattern = (torch.arange(ALL_REDUCE_NUMEL) % 13 + 1).float()
    contribution = rank_weight(world.rank) * pattern
    if faulty_rank == world.rank:
        contribution = contribution + 1000.0  # the injected fault: this rank's value is wrong
    expected = sum_rank_weights(world.world_size) * pattern
    x = contribution.to(world.device)
    results, seconds = _timed(world, iterations, lambda: distributed.all_reduce_sum(world, x))
    bad = _first_bad(results, expected)
    if bad:
        bad.name = "all_reduce"
        bad.detail += "; a rank contributed a wrong value or the reduction is broken"
        return bad
    return Check("all_reduce", PASSED, f"x[i] = {sum_rank_weights(world.world_size)}*(i%13+1)", "equal",
                 detail=f"{ALL_REDUCE_NUMEL} fp32 over {world.world_size} ranks; "
                        f"{_timing(seconds, ALL_REDUCE_NUMEL * 4 if world.distributed else None)}")


def check_all_gather(world: distributed.World, iterations: int) -> Check:
    # Rank r contributes [r*m, (r+1)*m); the gathered tensor is 0, 1, ..., W*m-1.
    m = ALL_GATHER_NUMEL
    x = (torch.arange(m) + world.rank * m).float().to(world.device)
    expected = torch.arange(m * world.world_size).float()
    results, seconds = _timed(world, iterations, lambda: distributed.all_gather(world, x))
    bad = _first_bad(results, expected)
    if bad:
        bad.name = "all_gather"
        return bad
    return Check("all_gather", PASSED, f"0..{m * world.world_size - 1}", "equal",
                 detail=f"{m} fp32 per rank; {_timing(seconds)}")


def check_reduce_scatter(world: distributed.World, iterations: int) -> Check:
    # Rank r contributes z_r[k] = a(r) * (k%1021+1) over W*m elements; rank r keeps chunk r of the
    # sum, S(W) * (k%1021+1) for k in [r*m, (r+1)*m) (1021 is prime, so chunks differ by rank).
    m, w = REDUCE_SCATTER_NUMEL, world.world_size
    pattern = (torch.arange(m * w) % 1021 + 1).float()
    x = (rank_weight(world.rank) * pattern).to(world.device)
    expected = sum_rank_weights(w) * pattern[world.rank * m:(world.rank + 1) * m]
    results, seconds = _timed(world, iterations, lambda: distributed.reduce_scatter_sum(world, x))
    bad = _first_bad(results, expected)
    if bad:
        bad.name = "reduce_scatter"
        return bad
    return Check("reduce_scatter", PASSED, f"chunk {world.rank}: {sum_rank_weights(w)}*(k%1021+1)", "equal",
                 detail=f"{m} fp32 per rank; {_timing(seconds)}")


# ----------------------------------------------------------------------------- main

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


def _node_phase(args: argparse.Namespace, report: Report, deadline: float) -> None:
    """Host checks on local rank 0; the other local ranks wait for them (nccom-test needs every
    NeuronCore of the node, so no rank may claim its core before it has finished)."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    multi = int(os.environ.get("WORLD_SIZE", "1")) > 1 and "MASTER_ADDR" in os.environ
    # A key per node and per torchrun restart, so a restarted group never sees a stale "done".
    key = (f"pipeline_sanity/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
           f"host_checks_done/{os.environ.get('GROUP_RANK', '0')}")
    if local_rank == 0:
        spec = INSTANCE_TYPES.get(args.instance_type) if args.instance_type else None
        try:
            HostChecks(report, spec, args.instance_type, args.fsx_path, args.bandwidth_floor_gbps,
                       args.iterations, deadline).run_all()
        finally:
            if multi:  # release the waiting ranks even when a host check blew up
                _node_store(deadline - time.monotonic()).set(key, "1")
        return
    for name in HOST_CHECKS:
        report.skip(name, "host check: run once per node by local rank 0")
    if multi:
        report.run("wait_host_checks", lambda: _wait(key, deadline))


def _wait(key: str, deadline: float) -> Check:
    remaining = deadline - time.monotonic()
    _node_store(remaining).wait([key], timedelta(seconds=max(1.0, remaining)))
    return Check("wait_host_checks", PASSED, detail="local rank 0 finished the host checks")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.iterations < 1:
        raise BadConfigError("--iterations must be >= 1")
    if args.expect_world_size is not None and args.expect_world_size < 1:
        raise BadConfigError("--expect-world-size must be >= 1")
    args.instance_type = expected_instance_type(args.instance_type, os.environ)
    backend = args.backend or distributed.default_backend()
    faulty = fault_rank(os.environ)
    expected_ws, ws_source = expected_world_size(args.expect_world_size, os.environ)
    out_dir = args.run_dir / "sanity"
    out_dir.mkdir(parents=True, exist_ok=True)

    rank = int(os.environ.get("RANK", "0"))
    report = Report(rank=rank, local_rank=int(os.environ.get("LOCAL_RANK", "0")),
                    world_size=int(os.environ.get("WORLD_SIZE", "1")), backend=backend)
    extra: dict[str, Any] = {"expected_world_size": expected_ws, "expected_world_size_source": ws_source,
                             "instance_type": args.instance_type, "fault_injection": None}
    if faulty is not None:
        log.warning("FAULT INJECTION ACTIVE: %s=%d makes rank %d contribute a wrong all_reduce value "
                    "(testing the detection path; unset it for real runs)", FAULT_RANK_ENV, faulty, faulty)
        extra["fault_injection"] = {"env": FAULT_RANK_ENV, "rank": faulty}
    rank_file = out_dir / f"rank-{rank}.json"

    def write_rank_file() -> None:
        atomic_write_json(rank_file, {**report.to_dict(), **extra, "versions": distributed.versions()})

    def on_stall(message: str) -> None:
        report.checks.append(Check("timeout", FAILED, expected=f"finish within {args.timeout_s:g} s",
                                   actual=f"still running check {report.current or '(between checks)'}",
                                   detail=message))
        write_rank_file()

    started = time.monotonic()
    deadline = started + args.timeout_s
    with Watchdog(args.timeout_s, what="sanity run", on_stall=on_stall):
        _node_phase(args, report, deadline)
        report.current = "process_group (joining the group, initialising the device)"
        try:
            world = distributed.init(backend)
        except RetryableError as exc:
            report.checks.append(Check("process_group", FAILED, expected="joined", actual="failed", detail=str(exc)))
            write_rank_file()
            raise
        report.current = None
        report.world_size = world.world_size
        report.run("world_size", lambda: Check(
            "world_size", PASSED if world.world_size == expected_ws else FAILED,
            expected_ws, world.world_size, detail=f"expected from {ws_source}"))
        report.run("device_matmul", lambda: check_matmul(world, args.iterations))
        report.run("all_reduce", lambda: check_all_reduce(world, args.iterations, faulty))
        report.run("all_gather", lambda: check_all_gather(world, args.iterations))
        report.run("reduce_scatter", lambda: check_reduce_scatter(world, args.iterations))
        write_rank_file()

        # ---- every rank learns which ranks failed (rank 0 reports them); one more collective.
        # Only when every collective completed (right or wrong values) is one more collective safe;
        # after a collective raised (a peer died, a link broke) it would just wait for the watchdog.
        collectives_ok = not report.raised & {"all_reduce", "all_gather", "reduce_scatter"}
        failed_ranks: list[int] | None = None
        if collectives_ok:
            flags = distributed.to_cpu(distributed.all_gather(
                world, torch.tensor([float(len(report.failed))]).to(world.device)))
            failed_ranks = [r for r, n in enumerate(flags.tolist()) if n > 0]
        if world.is_main:
            summary = _summary(report, extra, failed_ranks, out_dir, time.monotonic() - started)
            atomic_write_json(out_dir / "sanity.json", summary)
            # ---- tracking: this step as a child run of the pipeline's MLflow run (never fails the step)
            tracking.log_step("sanity", args.run_dir, params={"backend": backend}, metrics=tracking.flatten(summary))
        if collectives_ok:
            # Keep every rank alive until rank 0 has written sanity.json: torchrun stops the
            # whole group as soon as one rank exits non-zero.
            distributed.barrier(world)
        distributed.shutdown()

    problems = report.failed
    if problems or failed_ranks:
        lines = [f"  {c.name}: expected {c.expected}, actual {c.actual}" + (f" ({c.detail})" if c.detail else "")
                 for c in problems]
        others = [r for r in (failed_ranks or []) if r != rank]
        if others:
            lines.append(f"  checks also failed on ranks {others} (see {out_dir}/rank-<r>.json)")
        raise RetryableError(f"sanity failed on rank {rank} of {world.world_size}:\n" + "\n".join(lines)
                             + f"\nresults: {out_dir}")
    log.info("sanity passed: %d checks on %d rank(s), %d skipped; results in %s", len(report.checks),
             world.world_size, sum(c.status == SKIPPED for c in report.checks), out_dir)
    return ExitCode.OK


def _summary(report: Report, extra: dict[str, Any], failed_ranks: list[int] | None, out_dir: Path,
             seconds: float) -> dict[str, Any]:
    """sanity.json: rank 0's checks plus, for every failed rank, the names of its failed checks
    (read from its rank file: the run dir is on shared FSx in production)."""
    failures: dict[str, Any] = {}
    for r in failed_ranks or []:
        path = out_dir / f"rank-{r}.json"
        try:
            failures[str(r)] = [c for c in read_json(path)["checks"] if c["status"] == FAILED]
        except (OSError, ValueError, KeyError) as exc:
            failures[str(r)] = f"unreadable {path}: {exc}"
    if failed_ranks is None:  # the aggregation itself was skipped: collectives are broken
        failures[str(report.rank)] = [asdict(c) for c in report.failed]
    failed = bool(report.failed or failed_ranks)
    return {
        "status": FAILED if failed else PASSED,
        "exit_code": int(ExitCode.RETRYABLE if failed else ExitCode.OK),
        "world_size": report.world_size,
        "backend": report.backend,
        "host": report.host,
        "started_at": report.started_at,
        "seconds": round(seconds, 3),
        "failed_ranks": failed_ranks,
        "failures_by_rank": failures,
        "checks": [asdict(c) for c in report.checks],
        **extra,
        "versions": distributed.versions(),
    }
