"""The `compile` step: trace (on Trainium: compile) every graph `train` will need, ahead of time.

Takes exactly `train`'s arguments (+ `--steps N`, default 10) and writes DIR/compile/compile.json. On
Trainium it runs that training command under neuron_parallel_compile; on the XLA CPU backend the same
trial runs in-process; eager backends (cpu, cuda) have nothing to compile. Exit codes are `train`'s,
plus 78 for a graph the Neuron compiler rejects (not retried) and 75 for a killed trial (retried).

Local:  PJRT_DEVICE=CPU python -m pipeline_steps compile --run-dir runs/demo --preset tiny --backend xla
AWS:    python -m pipeline_steps compile --run-dir /fsx/runs/<run_id> --preset base --backend xla --bf16  # every node
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from . import distributed as dist_lib
from .contract import COMPILE_CACHE_DIR, COMPILE_DIR, COMPILE_REPORT, PREPARED_DIR
from .errors import EXIT_CODE_FILE_ENV, BadConfigError, ExitCode, RetryableError, StepError
from . import tracking
from .fileio import atomic_write_json
from .trainer import Trainer, add_train_args, resolve_train_config

log = logging.getLogger(__name__)

# Flags that belong to `compile` only; everything else on its command line is the training command.
_COMPILE_ONLY = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
_COMPILE_ONLY.add_argument("--steps", type=int, default=10, help="training steps in the trial (default 10)")


def trial_dir(run_dir: Path) -> Path:
    """A run dir that shares `prepared/` with the real one but keeps the trial's checkpoints apart."""
    trial = run_dir / COMPILE_DIR / "trial"
    if trial.exists():
        shutil.rmtree(trial)
    trial.mkdir(parents=True)
    (trial / PREPARED_DIR).symlink_to((run_dir / PREPARED_DIR).resolve(), target_is_directory=True)
    return trial


def training_argv(argv: list[str]) -> list[str]:
    """`compile`'s command line without its own flags: the `train` arguments, verbatim and in order."""
    return _COMPILE_ONLY.parse_known_args(argv)[1]


def neuron_command(train_argv: list[str], trial: Path, steps: int,
                   environ: Mapping[str, str]) -> tuple[list[str], dict[str, str]]:
    """The trial: exactly the training command, with the trial's run dir and step count appended
    (argparse keeps the last value), under neuron_parallel_compile, in the given environment."""
    # Not run under torchrun: the Compile job's entrypoint runs this step as plain python, and the trial
    # launches torchrun itself with the node's TORCHRUN_ARGS (training_image/entrypoint.sh).
    torchrun_args = shlex.split(environ.get("TORCHRUN_ARGS", "--standalone --nproc_per_node 32"))
    cmd = ["neuron_parallel_compile", "torchrun", *torchrun_args, "-m", "pipeline_steps", "train", *train_argv,
           "--run-dir", str(trial), "--max-steps", str(steps), "--no-progress"]
    return cmd, dict(environ)


def recorded_exit_code(path: Path) -> int | None:
    """The code the first failing training process recorded (errors.record_exit_code), if any."""
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def trial_failure(returncode: int, recorded: int | None) -> StepError:
    """Which failure a non-zero neuron_parallel_compile is, and so whether Batch retries it."""
    if returncode < 0:
        return RetryableError(f"neuron_parallel_compile was killed by signal {-returncode} (host OOM or "
                              "termination): transient, retried")
    if recorded == ExitCode.RETRYABLE:
        return RetryableError(f"the trial's training processes hit a transient fault (they recorded exit "
                              f"{recorded}; neuron_parallel_compile exited {returncode}); see the log above")
    if recorded is not None:
        error = StepError(f"the trial's training processes failed with exit {recorded} (the same as `train` "
                          f"would); neuron_parallel_compile exited {returncode}; see the log above")
        error.exit_code = ExitCode(recorded) if recorded in set(ExitCode) else ExitCode.INTERNAL
        return error
    return BadConfigError(
        f"neuron_parallel_compile exited {returncode} and no training process failed: the Neuron compiler "
        "rejected a graph (its error is in the log above). Not retried: the compile cache records the "
        "failed graph, so a rerun with the same preset and NEURON_CC_FLAGS repeats it. Fix the model "
        "config or the flags; after an environment failure (e.g. host OOM while compiling) rerun with "
        "--retry_failed_compilation added to NEURON_CC_FLAGS for both Compile and Train.")


def compile_on_neuron(args: argparse.Namespace, train_argv: list[str]) -> dict[str, Any]:
    if shutil.which("neuron_parallel_compile") is None:
        raise BadConfigError("neuron_parallel_compile is not on PATH: run compile inside the Neuron training image")
    dist_lib.configure_neuron_cache()  # the same call, so the same cache, as `train`
    cmd, env = neuron_command(train_argv, trial_dir(args.run_dir), args.steps, os.environ)
    if not env.get("NEURON_CC_FLAGS"):
        log.warning("NEURON_CC_FLAGS is not set: the trial compiles with neuronx-cc defaults, and `train` "
                    "must run without it too or it misses the cache")
    log.info("NEURON_CC_FLAGS=%s NEURON_COMPILE_CACHE_URL=%s", env.get("NEURON_CC_FLAGS", ""),
             env.get("NEURON_COMPILE_CACHE_URL", "(default local cache)"))
    log.info("running: %s", shlex.join(cmd))
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="compile-exit-") as tmp:
        # The trial's training processes record their exit code here (torchrun itself exits 1).
        code_file = Path(tmp) / "exit_code"
        result = subprocess.run(cmd, env={**env, EXIT_CODE_FILE_ENV: str(code_file)}, check=False)
        if result.returncode != 0:
            raise trial_failure(result.returncode, recorded_exit_code(code_file))
    return {"mode": "neuron_parallel_compile", "command": cmd, "neuron_cc_flags": env.get("NEURON_CC_FLAGS"),
            "cache_url": env.get("NEURON_COMPILE_CACHE_URL"), "seconds": time.monotonic() - started}


def compile_locally(args: argparse.Namespace) -> dict[str, Any]:
    world = dist_lib.init("xla")
    dist_lib.initialize_compile_cache(world, str(args.run_dir / COMPILE_CACHE_DIR))
    cfg = dataclasses.replace(resolve_train_config(args), max_steps=0)
    trial = trial_dir(args.run_dir)
    started = time.monotonic()
    trainer = Trainer(trial, args.preset, cfg, world, init_from=args.init_from)
    phases: dict[str, int | None] = {"setup": dist_lib.compile_count(world)}

    # Every length bucket once (a new shape is a new graph), then plain steps up to --steps.
    per_bucket = trainer.batches.first_batch_per_bucket()
    steps = 0
    for batch in dist_lib.device_batches(world, per_bucket):
        trainer.train_step(batch)
        trainer.xla.after_step(batch, trainer.state.step)
        steps += 1
    for _, _, batch in trainer.epochs():
        if steps >= args.steps:
            break
        trainer.train_step(batch)
        steps += 1
    phases["train_steps"] = dist_lib.compile_count(world)
    for batch in dist_lib.device_batches(world, trainer.holdout_batches.first_batch_per_bucket()):
        trainer.eval_step(batch)
    phases["validation_step"] = dist_lib.compile_count(world)
    trainer.save_checkpoint()
    phases["checkpoint"] = dist_lib.compile_count(world)
    return {"mode": "xla-cpu-trial", "train_steps": steps, "graphs_compiled": phases["checkpoint"],
            "graphs_by_phase": phases, "batch_shapes": trainer.xla.shapes,
            "buckets": list(trainer.data_cfg.length_buckets), "seconds": time.monotonic() - started}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m pipeline_steps compile", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     parents=[_COMPILE_ONLY])
    add_train_args(parser)
    args = parser.parse_args(argv)
    backend = args.backend or dist_lib.default_backend()
    out = args.run_dir / COMPILE_REPORT
    if backend != "xla":
        report: dict[str, Any] = {"mode": "skipped", "reason": f"backend {backend} runs eagerly: nothing to compile"}
        log.info("compile: %s", report["reason"])
    elif dist_lib.neuron_available():
        report = compile_on_neuron(args, training_argv(argv))
    else:
        report = compile_locally(args)
        log.info("compile: %d graphs traced in %d train steps + 1 validation step + 1 checkpoint (%.1fs)",
                 report["graphs_compiled"], report["train_steps"], report["seconds"])
    report["versions"] = dist_lib.versions()
    atomic_write_json(out, report)
    # ---- tracking: this step as a child run of the pipeline's MLflow run (never fails the step)
    tracking.log_step("compile", args.run_dir, params={"backend": backend, "preset": args.preset, "steps": args.steps},
                      metrics=tracking.flatten(report))
    return 0
