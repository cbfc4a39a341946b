"""The sanity step's host checks, run once per node by local rank 0: Neuron devices, EFA devices and
provider, the FSx for Lustre mount, and an nccom-test all-reduce over every NeuronCore of the node.
What each checks and why: docs/infrastructure.md."""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import time
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

from pipeline_contract import INSTANCE_TYPES, InstanceSpec

from .health_report import FAILED, PASSED, SKIPPED, Check, Report

TOOL_TIMEOUT_S = 120.0
NCCOM_TIMEOUT_S = 600.0
PROBE_BYTES = 1 << 20
ROOT_COMM_ENV = "NEURON_RT_ROOT_COMM_ID"  # the collectives' bootstrap address (training_image/entrypoint.sh)
INFINIBAND_DIR = Path("/dev/infiniband")  # where the job definition maps the EFA uverbs devices
NEURON_DEV_DIR = Path("/dev")  # /dev/neuron0..N-1, also mapped by the job definition


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
        table = {"devices": self.spec.neuron_devices, "cores": self.spec.neuron_cores}
        return Check(name, PASSED if actual == table else FAILED, expected=table, actual=actual,
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


def run_on_node(report: Report, *, instance_type: str | None, fsx_path: str | None, bandwidth_floor: float | None,
                iterations: int, deadline: float) -> None:
    """Host checks on local rank 0; the other local ranks wait for them (nccom-test needs every
    NeuronCore of the node, so no rank may claim its core before it has finished)."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    multi = int(os.environ.get("WORLD_SIZE", "1")) > 1 and "MASTER_ADDR" in os.environ
    # A key per node and per torchrun restart, so a restarted group never sees a stale "done".
    key = (f"pipeline_sanity/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
           f"host_checks_done/{os.environ.get('GROUP_RANK', '0')}")
    if local_rank == 0:
        spec = INSTANCE_TYPES.get(instance_type) if instance_type else None
        try:
            HostChecks(report, spec, instance_type, fsx_path, bandwidth_floor, iterations, deadline).run_all()
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
