"""The `compile` step: trace (on Trainium: compile) every graph `train` will need, ahead of time.

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
import dataclasses
import logging
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from . import distributed as dist_lib
from .contract import COMPILE_CACHE_DIR, COMPILE_DIR, COMPILE_REPORT, PREPARED_DIR
from .errors import EXIT_CODE_FILE_ENV, BadConfigError, ExitCode, RetryableError, StepError
from . import tracking
from .fileio import atomic_write_json, read_json
from .trainer import Trainer, add_train_args, resolve_train_config

log = logging.getLogger(__name__)

# Flags that belong to `compile` only; everything else on its command line is the training command.
_COMPILE_ONLY = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
_COMPILE_ONLY.add_argument("--steps", type=int, default=10, help="training steps in the trial (default 10)")
_COMPILE_ONLY.add_argument("--trial-dir", type=Path, default=None,
                           help="run the trial in this process, in DIR (what neuron_parallel_compile runs on "
                                "every rank); without it the step sets up the trial itself")
TRIALS_DIR = f"{COMPILE_DIR}/trial"
TRIAL_REPORT = "trial.json"


# ----------------------------------------------------------------------------- the trial's directory
# Every node of a Compile job runs this step at once on the same shared FSx directory, so nothing
# here may delete or replace what another node has created: each job attempt gets a directory of its
# own (every node derives the same name from the Batch job id and attempt), created idempotently,
# and only the main node removes the trials of earlier attempts (Batch has stopped their nodes).

def attempt_key(environ: Mapping[str, str]) -> str:
    """The trial's name: the same on every node of one Batch job attempt, new for each attempt
    (a retried trial must start from step 0, not resume the failed attempt's checkpoints)."""
    job_id = environ.get("AWS_BATCH_JOB_ID", "").split("#")[0]  # multi-node: <job id>#<node index>
    if job_id:
        return f"{job_id}-attempt{environ.get('AWS_BATCH_JOB_ATTEMPT', '1')}"
    return f"local-{uuid.uuid4().hex[:12]}"


def is_main_node(environ: Mapping[str, str]) -> bool:
    return environ.get("AWS_BATCH_JOB_NODE_INDEX", "0") == environ.get("AWS_BATCH_JOB_MAIN_NODE_INDEX", "0")


def trial_dir(run_dir: Path, key: str) -> Path:
    """DIR/compile/trial/<key>: a run dir that shares `prepared/` with the real one but keeps the
    trial's checkpoints apart. Safe to call from any number of processes at once."""
    trial = run_dir / TRIALS_DIR / key
    trial.mkdir(parents=True, exist_ok=True)
    prepared, link = (run_dir / PREPARED_DIR).resolve(), trial / PREPARED_DIR
    try:
        link.symlink_to(prepared, target_is_directory=True)
    except FileExistsError:
        if link.resolve() != prepared:
            raise BadConfigError(f"{link} points to {link.resolve()}, not {prepared}: remove {trial} and rerun")
    return trial


def prune_trials(run_dir: Path, keep: str) -> None:
    """Remove the trials of earlier attempts (main node only: they are no other node's)."""
    for entry in sorted((run_dir / TRIALS_DIR).iterdir()):
        if entry.name == keep:
            continue
        if entry.is_symlink() or not entry.is_dir():
            entry.unlink(missing_ok=True)
        else:
            shutil.rmtree(entry, ignore_errors=True)


def prepare_trial(run_dir: Path, environ: Mapping[str, str]) -> Path:
    key = attempt_key(environ)
    trial = trial_dir(run_dir, key)
    if is_main_node(environ):
        prune_trials(run_dir, keep=key)
    return trial


# ----------------------------------------------------------------------------- the trial

def run_trial(args: argparse.Namespace, trial: Path) -> dict[str, Any]:
    """Trace every graph `train` runs: one training step per length bucket (a new shape is a new
    graph), plain steps up to --steps, one holdout forward per bucket, one checkpoint. The same
    code in-process (XLA on CPU) and on every rank of the Neuron trial."""
    world = dist_lib.init("xla")
    try:
        dist_lib.initialize_compile_cache(world, str(args.run_dir / COMPILE_CACHE_DIR))
        with dist_lib.transient_faults_are_retryable(world, "compile trial"):
            report = _trace(args, trial, world)
        if world.is_main:
            atomic_write_json(trial / TRIAL_REPORT, report)
        return report
    finally:
        dist_lib.shutdown()


def _trace(args: argparse.Namespace, trial: Path, world: dist_lib.World) -> dict[str, Any]:
    cfg = dataclasses.replace(resolve_train_config(args), max_steps=0)
    started = time.monotonic()
    trainer = Trainer(trial, args.preset, cfg, world, init_from=args.init_from)
    phases: dict[str, int | None] = {"setup": dist_lib.compile_count(world)}
    steps = 0
    for batch in dist_lib.device_batches(world, trainer.batches.first_batch_per_bucket()):
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
    return {"trial_dir": str(trial), "train_steps": steps, "graphs_compiled": phases["checkpoint"],
            "graphs_by_phase": phases, "batch_shapes": trainer.xla.shapes,
            "buckets": list(trainer.data_cfg.length_buckets), "world_size": world.world_size,
            "seconds": time.monotonic() - started}


# ----------------------------------------------------------------------------- on Trainium

def training_argv(argv: list[str]) -> list[str]:
    """`compile`'s command line without its own flags: the `train` arguments, verbatim and in order."""
    return _COMPILE_ONLY.parse_known_args(argv)[1]


def neuron_command(train_argv: list[str], trial: Path, steps: int,
                   environ: Mapping[str, str]) -> tuple[list[str], dict[str, str]]:
    """The trial under neuron_parallel_compile: launched on this node as `train` is (torchrun with
    the node's TORCHRUN_ARGS, through the launcher: training_image/entrypoint.sh), every rank runs
    this step with the training arguments verbatim plus the trial's steps and directory, in the
    given environment."""
    # Not run under torchrun: the Compile job's entrypoint runs this step as plain python.
    torchrun_args = shlex.split(environ.get("TORCHRUN_ARGS", "--standalone --nproc_per_node 32"))
    cmd = ["neuron_parallel_compile", sys.executable, "-m", "pipeline_steps.launch", *torchrun_args,
           "-m", "pipeline_steps", "compile", *train_argv, "--steps", str(steps), "--trial-dir", str(trial)]
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
        return RetryableError(f"the trial hit a transient fault (a process recorded exit {recorded}: a lost "
                              f"peer, a rendezvous that never completed, a runtime timeout; "
                              f"neuron_parallel_compile exited {returncode}); see the log above")
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
    dist_lib.configure_neuron_cache()  # the cache every XLA step joins in distributed.init
    trial = prepare_trial(args.run_dir, os.environ)
    cmd, env = neuron_command(train_argv, trial, args.steps, os.environ)
    if not env.get("NEURON_CC_FLAGS"):
        log.warning("NEURON_CC_FLAGS is not set: the trial compiles with neuronx-cc defaults, and `train` "
                    "must run without it too or it misses the cache")
    log.info("NEURON_CC_FLAGS=%s NEURON_COMPILE_CACHE_URL=%s", env.get("NEURON_CC_FLAGS", ""),
             env.get("NEURON_COMPILE_CACHE_URL", "(default local cache)"))
    log.info("running: %s", shlex.join(cmd))
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="compile-exit-") as tmp:
        # The trial's processes record their exit code here (torchrun itself exits 1).
        code_file = Path(tmp) / "exit_code"
        result = subprocess.run(cmd, env={**env, EXIT_CODE_FILE_ENV: str(code_file)}, check=False)
        if result.returncode != 0:
            raise trial_failure(result.returncode, recorded_exit_code(code_file))
    trial_report = trial / TRIAL_REPORT
    return {"mode": "neuron_parallel_compile", "command": cmd, "neuron_cc_flags": env.get("NEURON_CC_FLAGS"),
            "cache_url": env.get("NEURON_COMPILE_CACHE_URL"), "seconds": time.monotonic() - started,
            "trial": read_json(trial_report) if trial_report.exists() else None}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m pipeline_steps compile", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     parents=[_COMPILE_ONLY])
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
