"""A local AWS Batch: runs every submitted job for real, as Batch would run the job definition.

For each job the state machine submits (through moto, tests/infra/moto_batch.py `run_job` hook):
- the command is the job definition's, with `Ref::name` placeholders replaced by the submit's
  parameters over the definition's defaults (Batch: "Parameters in job submission requests take
  precedence over the defaults in a job definition",
  https://docs.aws.amazon.com/batch/latest/userguide/job_definition_parameters.html#parameters);
- it runs as `training_image/entrypoint.sh <command>` (the image's ENTRYPOINT), with the
  definition's environment plus the variables Batch sets
  (https://docs.aws.amazon.com/batch/latest/userguide/job_env_vars.html): AWS_BATCH_JOB_ID,
  AWS_BATCH_JOB_ATTEMPT, AWS_BATCH_JQ_NAME, AWS_BATCH_CE_NAME; AWS_BATCH_JOB_ARRAY_INDEX on array
  children; AWS_BATCH_JOB_NODE_INDEX / NUM_NODES / MAIN_NODE_INDEX on every node of a multi-node
  job and AWS_BATCH_JOB_MAIN_NODE_PRIVATE_IPV4_ADDRESS on the child nodes only
  (https://docs.aws.amazon.com/batch/latest/userguide/multi-node-parallel-jobs.html);
- a multi-node job is N node processes (N from NodeOverrides, else the definition), started main
  node first; the job's exit code is the main node's;
- exit code -> status, and the definition's evaluateOnExit decides a retry: the first entry whose
  every given condition matches wins; patterns may end in `*`; when no entry matches the job is
  retried; at most `attempts` attempts
  (https://docs.aws.amazon.com/batch/latest/APIReference/API_EvaluateOnExit.html,
  https://docs.aws.amazon.com/batch/latest/userguide/job_retries.html).

What differs from AWS is listed, with its reason, in tests/e2e/substitutions.py (the one list;
`LocalSetup.describe()` prints it): /fsx at a local directory, `--backend cpu` for XLA jobs of more
than one process, sanity without its Lustre, device and EFA checks, NPROC_PER_NODE 1, recording
stand-ins for the Neuron tools, moto for every AWS API the steps call (AWS_ENDPOINT_URL).
"""

from __future__ import annotations

import fcntl
import fnmatch
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from tests.e2e import standin
from tests.e2e.substitutions import (
    DROPPED,
    FSX_MOUNT,
    PROCESSES_PER_NODE,
    SANITY_INSTANCE_TYPE,
    SUBSTITUTIONS,
    XLA_ACROSS_PROCESSES,
)
from tests.suite_environment import SUITE_ENVIRONMENT

REPO_ROOT = Path(__file__).resolve().parents[2]
ENTRYPOINT = REPO_ROOT / "training_image" / "entrypoint.sh"
FSX = FSX_MOUNT.what
LOOPBACK = "127.0.0.1"
RENDEZVOUS_PORT = 29500  # training_image/entrypoint.sh MASTER_PORT
# The steps entrypoint.sh runs under torchrun (compile: its trial, through the same launcher), which
# listen on RENDEZVOUS_PORT even on one node.
RENDEZVOUS_STEPS = frozenset({"sanity", "train", "compile"})
PORT_WAIT_S = 600.0
# Seconds a child node may outlive the main node before it is stopped (Batch ends the job when
# the main node exits).
CHILD_GRACE_S = 30.0


@dataclass(frozen=True)
class JobDefinitionSpec:
    """What the local Batch needs of one synthesized AWS::Batch::JobDefinition."""

    name: str
    command: list[str]
    environment: dict[str, str]
    parameters: dict[str, str]
    attempts: int
    evaluate_on_exit: list[dict[str, str]]
    num_nodes: int | None = None  # None: a single-node (container) job
    main_node: int = 0
    timeout_s: int | None = None

    @classmethod
    def from_properties(cls, name: str, props: dict[str, Any]) -> JobDefinitionSpec:
        """From resolved CloudFormation properties (PascalCase, as synthesized)."""
        node_props = props.get("NodeProperties")
        if node_props:
            (node_range,) = node_props["NodeRangeProperties"]
            container = node_range["Container"]
        else:
            container = props["ContainerProperties"]
        retry = props.get("RetryStrategy", {})
        return cls(
            name=name,
            command=list(container.get("Command", [])),
            environment={e["Name"]: str(e["Value"]) for e in container.get("Environment", [])},
            parameters=dict(props.get("Parameters", {})),
            attempts=int(retry.get("Attempts", 1)),
            evaluate_on_exit=list(retry.get("EvaluateOnExit", [])),
            num_nodes=int(node_props["NumNodes"]) if node_props else None,
            main_node=int(node_props["MainNode"]) if node_props else 0,
            timeout_s=props.get("Timeout", {}).get("AttemptDurationSeconds"),
        )


def substitute(command: list[str], parameters: dict[str, str]) -> list[str]:
    """Replace every `Ref::name` whose name is a parameter; unknown placeholders stay (the
    entrypoint refuses them, as it would on AWS)."""
    out = []
    for arg in command:
        for name in sorted(parameters, key=len, reverse=True):  # Ref::ab before Ref::a
            arg = arg.replace(f"Ref::{name}", str(parameters[name]))
        out.append(arg)
    return out


def retry_action(evaluate_on_exit: list[dict[str, str]], exit_code: int | None, status_reason: str) -> str:
    """RETRY or EXIT, as Batch decides it from evaluateOnExit (glob patterns, first match wins,
    no match = RETRY). OnReason is matched against the container's reason, which is empty here."""
    for rule in evaluate_on_exit:
        conditions = {"OnExitCode": "" if exit_code is None else str(exit_code),
                      "OnStatusReason": status_reason, "OnReason": ""}
        given = {key: rule[key] for key in conditions if key in rule}
        if given and all(fnmatch.fnmatchcase(conditions[key], pattern) for key, pattern in given.items()):
            return rule["Action"].upper()
    return "RETRY"


@dataclass
class Attempt:
    number: int
    exit_code: int | None
    status_reason: str
    seconds: float
    node_exit_codes: list[int | None]
    logs: list[Path]  # one per node, main node first
    argv: list[str]  # what every node ran
    environments: list[dict[str, str]]  # per node, main node first
    started_at: datetime
    stopped_at: datetime


@dataclass
class JobRun:
    """One Batch job (an array child is its own JobRun) as it ran here."""

    job_id: str
    job_name: str
    definition: str
    nodes: int
    array_index: int | None = None
    parameters: dict[str, str] = field(default_factory=dict)
    attempts: list[Attempt] = field(default_factory=list)

    @property
    def succeeded(self) -> bool:
        return bool(self.attempts) and self.attempts[-1].exit_code == 0

    @property
    def exit_code(self) -> int | None:
        return self.attempts[-1].exit_code if self.attempts else None

    @property
    def seconds(self) -> float:
        return sum(a.seconds for a in self.attempts)


@dataclass(frozen=True)
class Fault:
    """Kill a node (SIGKILL of all its processes, as a lost host would) during one attempt
    of one job, once `ready(fsx_root)` returns True (e.g. a checkpoint exists)."""

    job_name: str
    attempt: int
    node_index: int
    ready: Callable[[Path, dict[str, str]], bool]


@dataclass
class LocalSetup:
    """Where and how jobs run on this machine."""

    work_dir: Path
    endpoint_url: str
    region: str
    nproc_per_node: int = 1
    attempt_timeout_s: float = 900.0  # a local guard; the definitions' own timeouts are hours

    @property
    def fsx_root(self) -> Path:
        return self.work_dir / "fsx"

    @property
    def bin_dir(self) -> Path:
        return self.work_dir / "bin"

    @property
    def log_dir(self) -> Path:
        return self.work_dir / "logs"

    @property
    def standin_record(self) -> Path:
        return self.work_dir / "standins.jsonl"

    def describe(self) -> list[str]:
        """Where things are here, then every substitution with its reason (substitutions.py)."""
        return [f"/fsx -> {self.fsx_root}", f"AWS APIs -> moto at {self.endpoint_url}",
                f"NPROC_PER_NODE={self.nproc_per_node}",
                *(f"{s.what} -> {s.instead}: {s.reason}" for s in SUBSTITUTIONS)]


def local_arguments(args: list[str], fsx_root: Path, processes: int) -> list[str]:
    """The container arguments as this machine can run them: only the argument substitutions of
    substitutions.py that apply to this command and number of processes."""
    command = args[0] if args else ""
    dropped = {s.what for s in SUBSTITUTIONS if s.instead == DROPPED and s.applies(command, processes)}
    cpu_for_xla = XLA_ACROSS_PROCESSES.applies(command, processes)
    out: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        nxt = args[i + 1] if i + 1 < len(args) else None
        if arg in dropped and nxt is not None:
            i += 2
            continue
        if cpu_for_xla and arg == "--backend" and nxt == "xla":
            out += [arg, "cpu"]
            i += 2
            continue
        out.append(local_path(arg, fsx_root))
        i += 1
    return out


def local_path(arg: str, fsx_root: Path) -> str:
    """An argument under /fsx at its local place (FSX_MOUNT)."""
    return str(fsx_root) + arg[len(FSX):] if arg == FSX or arg.startswith(FSX + "/") else arg


class LocalBatch:
    """Runs moto Batch jobs for real. `definitions`: job definition ARN -> spec."""

    def __init__(self, setup: LocalSetup, definitions: dict[str, JobDefinitionSpec],
                 before_job: Callable[[], None] | None = None) -> None:
        self.setup = setup
        self.definitions = definitions
        self.before_job = before_job
        self.runs: list[JobRun] = []
        self.faults: list[Fault] = []
        self.compute_environment = "local-ce"
        setup.fsx_root.mkdir(parents=True, exist_ok=True)
        setup.log_dir.mkdir(parents=True, exist_ok=True)
        standin.install(setup.bin_dir, sys.executable)
        self._lock = threading.Lock()

    def standin_records(self) -> list[dict]:
        """Every recorded call of a stand-in tool (tests/e2e/standin.py), in call order."""
        return standin.read_records(self.setup.standin_record)

    # ---- the moto hook ---------------------------------------------------------------------
    def run_moto_job(self, job: Any, submitted: list[dict]) -> bool:
        """Run one moto Job (a plain job, a multi-node job or an array child); fill its attempts,
        exit code and status reason as DescribeJobs reports them. Returns success."""
        spec = self.definitions[job.job_definition.arn]
        is_array_parent = "size" in job.array_properties
        if is_array_parent:  # children ran first (moto submits them before the parent)
            children = [j for jid, j in job.backend._jobs.items() if jid.startswith(f"{job.job_id}:")]
            return bool(children) and all(c.status == "SUCCEEDED" for c in children)
        # moto keeps the job's own parameters; the submission (for its node overrides) is found by name and
        # parameters: two runs (two teams' pipelines) submit jobs of the same name at the same time
        parameters = {**spec.parameters, **job.parameters}
        submission = next((s for s in reversed(submitted) if s.get("jobName") == job.job_name
                           and s.get("parameters", {}).items() <= parameters.items()), {})
        nodes = None
        if spec.num_nodes is not None:
            nodes = int(submission.get("nodeOverrides", {}).get("numNodes", spec.num_nodes))
        run = JobRun(job_id=job.job_id, job_name=job.job_name, definition=spec.name, nodes=nodes or 1,
                     array_index=job.array_properties.get("index"), parameters=parameters)
        with self._lock:
            self.runs.append(run)
        job.attempts.clear()
        while True:
            attempt = self._attempt(spec, run, parameters, job.job_queue.name, len(run.attempts) + 1)
            run.attempts.append(attempt)
            job.attempts.append({
                "container": {"exitCode": attempt.exit_code, "logStreamName": str(attempt.logs[0])},
                "startedAt": int(attempt.started_at.timestamp() * 1000),
                "stoppedAt": int(attempt.stopped_at.timestamp() * 1000),
                "statusReason": attempt.status_reason})
            if attempt.exit_code == 0:
                break
            if len(run.attempts) >= spec.attempts or \
                    retry_action(spec.evaluate_on_exit, attempt.exit_code, attempt.status_reason) == "EXIT":
                break
        job.latest_attempt = None  # moto's _stop_attempt must not overwrite ours
        job.exit_code = run.exit_code
        if not run.succeeded:
            job.job_stopped_reason = run.attempts[-1].status_reason
        return run.succeeded

    # ---- one attempt -----------------------------------------------------------------------
    def _attempt(self, spec: JobDefinitionSpec, run: JobRun, parameters: dict[str, str], queue: str,
                 number: int) -> Attempt:
        if self.before_job is not None:
            self.before_job()
        node_count = run.nodes if spec.num_nodes is not None else None
        processes = (node_count or 1) * self.setup.nproc_per_node
        argv = ["bash", str(ENTRYPOINT),
                *local_arguments(substitute(spec.command, parameters), self.setup.fsx_root, processes)]
        rendezvous = node_count is not None or spec.command[0] in RENDEZVOUS_STEPS
        with _rendezvous_port(RENDEZVOUS_PORT) if rendezvous else nullcontext():
            started, t0 = datetime.now(), time.monotonic()
            procs: list[subprocess.Popen] = []
            logs: list[Path] = []
            environments: list[dict[str, str]] = []
            indices = [spec.main_node] + [i for i in range(node_count or 1) if i != spec.main_node]
            for index in indices:  # Batch starts the main node first, then the children
                env = self._environment(spec, run, queue, number, index if node_count else None, node_count)
                environments.append(env)
                suffix = f"-node{index}" if node_count else (
                    f"-{run.array_index}" if run.array_index is not None else "")
                log_path = self.setup.log_dir / f"{run.job_name}{suffix}-{run.job_id[:8]}-attempt{number}.log"
                with open(log_path, "wb") as log_fh:
                    procs.append(subprocess.Popen(argv, env=env, stdout=log_fh, stderr=subprocess.STDOUT,
                                                  cwd=self.setup.work_dir, start_new_session=True))
                logs.append(log_path)
            codes, reason = self._wait(spec, run, number, procs, indices, parameters)
        main_code = codes[0]
        if not reason:
            reason = "Essential container in task exited"
        return Attempt(number=number, exit_code=main_code, status_reason=reason,
                       seconds=time.monotonic() - t0, node_exit_codes=codes, logs=logs, argv=argv,
                       environments=environments,
                       started_at=started, stopped_at=datetime.now())

    def _environment(self, spec: JobDefinitionSpec, run: JobRun, queue: str, attempt: int,
                     node_index: int | None, num_nodes: int | None) -> dict[str, str]:
        setup = self.setup
        venv_bin = str(Path(sys.executable).parent)
        env = {
            # The host side: a PATH with the stand-ins and this interpreter's torchrun/python.
            "PATH": os.pathsep.join([str(setup.bin_dir), venv_bin, "/usr/local/bin", "/usr/bin", "/bin"]),
            "HOME": os.environ.get("HOME", str(setup.work_dir)),
            "PYTHONPATH": str(REPO_ROOT),
            "PYTHONUNBUFFERED": "1",  # as the image sets it
            **SUITE_ENVIRONMENT,  # one thread per process on 2 shared cores; XLA's CPU compile at -O0
            "TMPDIR": str(setup.work_dir / "tmp"),
            "AWS_ENDPOINT_URL": setup.endpoint_url,
            "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_REGION": setup.region,
            "E2E_STANDIN_RECORD": str(setup.standin_record),
            # The job definition, then what Batch sets.
            **spec.environment,
            PROCESSES_PER_NODE.what: str(setup.nproc_per_node),
            "AWS_BATCH_JOB_ID": run.job_id if node_index is None else f"{run.job_id}#{node_index}",
            "AWS_BATCH_JOB_ATTEMPT": str(attempt),
            "AWS_BATCH_JQ_NAME": queue,
            "AWS_BATCH_CE_NAME": self.compute_environment,
        }
        if SANITY_INSTANCE_TYPE.applies(spec.command[0], (num_nodes or 1) * setup.nproc_per_node):
            env.pop(SANITY_INSTANCE_TYPE.what, None)
        (setup.work_dir / "tmp").mkdir(exist_ok=True)
        if run.array_index is not None:
            env["AWS_BATCH_JOB_ARRAY_INDEX"] = str(run.array_index)
        if node_index is not None and num_nodes is not None:
            env["AWS_BATCH_JOB_NODE_INDEX"] = str(node_index)
            env["AWS_BATCH_JOB_NUM_NODES"] = str(num_nodes)
            env["AWS_BATCH_JOB_MAIN_NODE_INDEX"] = str(spec.main_node)
            if node_index != spec.main_node:
                env["AWS_BATCH_JOB_MAIN_NODE_PRIVATE_IPV4_ADDRESS"] = LOOPBACK
        return env

    def _wait(self, spec: JobDefinitionSpec, run: JobRun, number: int, procs: list[subprocess.Popen],
              indices: list[int], parameters: dict[str, str]) -> tuple[list[int | None], str]:
        """Exit codes in `indices` order (main node first) and a status reason when not a plain exit."""
        deadline = time.monotonic() + self.setup.attempt_timeout_s
        faults = [f for f in self.faults if f.job_name == run.job_name and f.attempt == number]
        reason = ""
        while procs[0].poll() is None:
            for fault in list(faults):
                if fault.ready(self.setup.fsx_root, parameters):
                    _kill_tree(procs[indices.index(fault.node_index)], signal.SIGKILL)
                    faults.remove(fault)
                    self.faults.remove(fault)  # once: a later job of the same name runs unharmed
            if time.monotonic() > deadline:
                reason = f"Job attempt duration exceeded the local guard of {self.setup.attempt_timeout_s:g} s"
                for proc in procs:
                    _kill_tree(proc, signal.SIGTERM)
                try:
                    procs[0].wait(timeout=30)
                except subprocess.TimeoutExpired:
                    _kill_tree(procs[0], signal.SIGKILL)
                break
            time.sleep(0.05)
        grace = time.monotonic() + CHILD_GRACE_S
        for proc in procs[1:]:  # Batch stops the children when the main node has exited
            for sig, wait_s in ((None, grace - time.monotonic()), (signal.SIGTERM, 10.0), (signal.SIGKILL, None)):
                if sig is not None:
                    _kill_tree(proc, sig)
                try:
                    proc.wait(timeout=None if wait_s is None else max(0.1, wait_s))
                    break
                except subprocess.TimeoutExpired:
                    continue
        # Popen reports a signal as -N; a container killed by signal N exits 128 + N.
        return [code if code >= 0 else 128 - code for code in (proc.wait() for proc in procs)], reason


@contextmanager
def _rendezvous_port(port: int) -> Iterator[None]:
    """The entrypoint's rendezvous port is fixed (each Batch node has its own network interface);
    here every node shares this host's, so one job that rendezvouses at a time holds it (a
    multi-node job, or a single-node job of a torchrun step: a canary's sanity): a lock file
    orders the jobs of every e2e world on this host (parallel test workers, a `make e2e` beside
    the tests), and the port must be free of anything else too."""
    with open(Path(tempfile.gettempdir()) / f"trainium-e2e-rendezvous-{port}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        _wait_for_free_port(port, PORT_WAIT_S)
        yield


def _wait_for_free_port(port: int, timeout_s: float) -> None:
    """Until `port` can be bound (another program may hold it), or `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is no obstacle
            try:
                probe.bind(("0.0.0.0", port))
                return
            except OSError:
                if time.monotonic() > deadline:
                    return  # go on: torchrun's own error then names the port
        time.sleep(1.0)


def _descendants(pid: int) -> list[int]:
    """Every live process below `pid` (torchrun starts its workers in sessions of their own, so
    a process group does not cover a node)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited meanwhile
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _kill_tree(proc: subprocess.Popen, sig: int) -> None:
    """Signal a node: its entrypoint and everything it started. Not once the entrypoint has been
    reaped: its pid (and so the tree below it) may belong to someone else by then."""
    if proc.poll() is not None:
        return
    for pid in [proc.pid, *_descendants(proc.pid)]:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def clean(work_dir: Path) -> None:
    """Remove a previous e2e work dir (runs, logs, records)."""
    if work_dir.exists():
        shutil.rmtree(work_dir)
