"""`make e2e`: upload a dataset and watch the synthesized dev pipeline run it, every job for real.

    python -m tests.e2e [--work-dir runs/e2e] [--nproc-per-node 1] [--preset tiny]

Synthesizes the dev stage, puts its state machines, new-data rule and job definitions into moto,
uploads the demo data to incoming/catalog/<version>/ (the _SUCCESS marker last), lets the rule's
starter start the run, and runs each submitted Batch job locally (tests/e2e/local_batch.py).
Prints the executed path (state, job, nodes, attempts, exit codes, seconds) and the execution
status. Then a run by hand on one node from the published model: every job is one process, so
Compile and Train run their job definitions' commands unchanged (--backend xla, the stage's
precision and NEURON_CC_FLAGS) on PJRT CPU. Exits 0 when both executions succeeded, 1 otherwise.
What runs differently here and why: tests/e2e/substitutions.py. Job logs: WORK_DIR/logs/.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from pipeline_steps.contract import run_path
from pipeline_steps.demo_data import write_demo

from tests.e2e.local_batch import clean
from tests.e2e.world import E2EWorld, one_node_run_input

DATASET, VERSION = "catalog", "v1"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.e2e", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work-dir", type=Path, default=Path("runs/e2e"))
    parser.add_argument("--nproc-per-node", type=int, default=1, help="torchrun processes per node (CPU)")
    parser.add_argument("--preset", default="tiny", help="the job definitions' preset parameter default")
    args = parser.parse_args(argv)
    started = time.monotonic()
    work_dir = args.work_dir.resolve()
    clean(work_dir)
    demo = write_demo(work_dir / "upload", args.preset)
    print(f"e2e: synthesizing the dev stage; work dir {work_dir}", flush=True)
    with E2EWorld(work_dir, nproc_per_node=args.nproc_per_node, preset=args.preset) as world:
        for line in world.batch.setup.describe():
            print(f"e2e: local: {line}", flush=True)
        key = world.upload_dataset(DATASET, VERSION, demo)
        print(f"e2e: uploaded s3://{world.buckets['data_bucket']}/{key}; waiting for the run", flush=True)
        result = world.wait_for_run(f"{DATASET}-{VERSION}")
        print(world.format_path(result))
        # The production commands unchanged: one node, one process per job (XLA, bf16, NEURON_CC_FLAGS).
        print("e2e: a run on one node from the published model: Compile and Train as deployed", flush=True)
        one_node = world.start_run(f"{DATASET}-{VERSION}-one-node", one_node_run_input(
            DATASET, VERSION, init_from=run_path(f"{DATASET}-{VERSION}")))
        print(world.format_path(one_node))
    print(f"e2e: {time.monotonic() - started:.0f} s wall time")
    return 0 if result.status == one_node.status == "SUCCEEDED" else 1


if __name__ == "__main__":
    sys.exit(main())
