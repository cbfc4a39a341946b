"""compile: trace (on Trainium: compile) every graph `train` will need, ahead of time.

Takes exactly `train`'s arguments (+ `--steps N`, default 10) and writes DIR/compile/compile.json.
One trial on every backend (a training step per length bucket, plain steps up to --steps, a
holdout forward per bucket, a checkpoint) in a run dir all nodes share (DIR/compile/trial/<job
attempt>/): on Trainium every node runs it under neuron_parallel_compile and torchrun, as Train is
launched, and the tool compiles what it traced into the persistent cache; on XLA CPU in-process;
eager backends have nothing to compile. Exit codes are `train`'s, plus 78 for a graph the Neuron
compiler rejects (not retried) and 75 for a killed trial (retried).

Local:  PJRT_DEVICE=CPU python -m pipeline_steps compile --run-dir runs/demo --preset tiny --backend xla
AWS:    python -m pipeline_steps compile --run-dir /fsx/runs/<run_id> --preset base --backend xla --bf16  # every node
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

from pipeline_contract import COMPILE_REPORT

from .. import distributed as dist_lib
from .. import tracking
from ..compile_trial import COMPILE_ONLY, compile_on_neuron, is_main_node, prepare_trial, run_trial, training_argv
from ..fileio import atomic_write_json
from ..trainer import add_train_args

log = logging.getLogger("pipeline_steps.compile")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m pipeline_steps compile", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     parents=[COMPILE_ONLY])
    add_train_args(parser)
    args = parser.parse_args(argv)
    backend = args.backend or dist_lib.default_backend()
    if backend != "xla":
        report: dict[str, Any] = {"mode": "skipped", "reason": f"backend {backend} runs eagerly: nothing to compile"}
        log.info("compile: %s", report["reason"])
    elif args.trial_dir is not None:  # one rank of the Neuron trial; the node's compile step reports
        run_trial(args, args.trial_dir)
        return 0
    elif dist_lib.neuron_available():
        report = compile_on_neuron(args, training_argv(argv))
    else:
        report = {"mode": "xla-cpu-trial", **run_trial(args, prepare_trial(args.run_dir, os.environ))}
        log.info("compile: %d graphs traced in %d train steps + 1 validation step + 1 checkpoint (%.1fs)",
                 report["graphs_compiled"], report["train_steps"], report["seconds"])
    if not is_main_node(os.environ):  # every node ran the same trial; the main node reports it
        return 0
    report["versions"] = dist_lib.versions()
    atomic_write_json(args.run_dir / COMPILE_REPORT, report)
    # ---- tracking: this step as a child run of the pipeline's MLflow run (never fails the step)
    tracking.log_step("compile", args.run_dir, params={"backend": backend, "preset": args.preset, "steps": args.steps},
                      metrics=tracking.flatten(report))
    return 0
