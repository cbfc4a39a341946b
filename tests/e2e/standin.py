"""Recording stand-ins for the tools the Neuron training image has and this machine lacks.

    python -m tests.e2e.standin <tool> [args...]      (installed on PATH as <tool> by `install`)

Every call appends one JSON line {tool, argv, env, cwd, job_id, node_index, attempt} to the file
named by $E2E_STANDIN_RECORD, so tests can assert what each tool was given. Then:
- neuron_parallel_compile runs the wrapped command (its arguments) with the same environment and
  exits with its code, as the real tool does after its trial run;
- neuron-ls, fi_info and nccom-test print what a healthy host of $INSTANCE_TYPE reports (device
  and core counts, EFA providers, an all-reduce result row), in the formats sanity parses. They
  prove nothing about hardware: they are there so the calls happen and are recorded.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
from pathlib import Path

RECORD_ENV = "E2E_STANDIN_RECORD"
TOOLS = ("neuron_parallel_compile", "neuron-ls", "fi_info", "nccom-test")
# (Neuron devices, NeuronCores, EFA interfaces) per instance type, as the sanity step (pipeline_steps/host_checks.py) expects.
HOSTS = {"trn1.32xlarge": (16, 32, 8), "trn1n.32xlarge": (16, 32, 16), "trn1.2xlarge": (1, 2, 0)}


def install(bin_dir: Path, python: str) -> Path:
    """Write one executable wrapper per tool into bin_dir (put it first on PATH)."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    for tool in TOOLS:
        script = bin_dir / tool
        script.write_text(f'#!/bin/sh\nexec "{python}" -m tests.e2e.standin {tool} "$@"\n')
        script.chmod(0o755)
    return bin_dir


def read_records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _record(tool: str, args: list[str]) -> None:
    path = os.environ.get(RECORD_ENV)
    if not path:
        return
    line = json.dumps({"tool": tool, "argv": [tool, *args], "env": dict(os.environ), "cwd": os.getcwd(),
                       "job_id": os.environ.get("AWS_BATCH_JOB_ID"),
                       "node_index": os.environ.get("AWS_BATCH_JOB_NODE_INDEX"),
                       "attempt": os.environ.get("AWS_BATCH_JOB_ATTEMPT")})
    with open(path, "a", encoding="utf-8") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)  # several nodes record at once
        fh.write(line + "\n")


def _host() -> tuple[int, int, int]:
    return HOSTS.get(os.environ.get("INSTANCE_TYPE", ""), (1, 2, 0))


def main(argv: list[str]) -> int:
    tool, args = argv[0], argv[1:]
    if tool not in TOOLS:
        print(f"standin: unknown tool {tool!r}; one of {', '.join(TOOLS)}", file=sys.stderr)
        return 2
    _record(tool, args)
    devices, cores, efa = _host()
    if tool == "neuron_parallel_compile":
        if not args:
            print("neuron_parallel_compile: no command to run", file=sys.stderr)
            return 2
        return subprocess.run(args, check=False).returncode
    if tool == "neuron-ls":
        per_device = cores // devices
        print(json.dumps([{"neuron_device": i, "nc_count": per_device,
                           "neuroncore_ids": list(range(i * per_device, (i + 1) * per_device))}
                          for i in range(devices)]))
    elif tool == "fi_info":
        if efa == 0:
            print("fi_getinfo: -61 (No data available)", file=sys.stderr)
            return 1
        print("\n".join(f"provider: efa\n    fabric: efa\n    domain: rdmap{i}-rdm" for i in range(efa)))
    else:  # nccom-test: one 32 MiB fp32 all-reduce row, the shape nccom-test prints
        print("       size(B)    count(elems)    type    time(us)    algbw(GB/s)    busbw(GB/s)\n"
              "      33554432         8388608    fp32         768          40.69          40.69\n"
              "Avg bus bandwidth:      40.6901GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
