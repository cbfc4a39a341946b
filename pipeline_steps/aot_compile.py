"""The `compile` step: trace (and on Trainium, compile) every graph training will need, ahead of time.

Reads   DIR/prepared/ (from `prepare`), and the same flags as `train`.
Writes  DIR/compile/compile.json (graphs traced, their batch shapes, seconds), DIR/compile/trial/
        (the trial's throw-away checkpoints: trial weights are never used), and locally
        DIR/compile/xla_cache/ (the ledger `train` checks its graphs against).

Trainium (per node; not under torchrun: it launches torchrun itself, from $TORCHRUN_ARGS):
    python -m pipeline_steps compile --run-dir /fsx/runs/$RUN_ID --preset base --backend xla --bf16 \
        --cache-url s3://<cache bucket>/neuron
  runs `neuron_parallel_compile torchrun $TORCHRUN_ARGS -m pipeline_steps train <the same flags>
  --max-steps 10` -- the same world size and arguments as training, or the cache misses -- with
  NEURON_CC_FLAGS defaulting to M5's `--target trn1 --model-type transformer --optlevel 1` and
  NEURON_COMPILE_CACHE_URL=<cache url>/neuronx-cc-<version>/ (compiler upgrades never read stale NEFFs).
Local (PyTorch/XLA on CPU):
    PJRT_DEVICE=CPU python -m pipeline_steps compile --run-dir runs/demo --preset tiny --backend xla
  runs the same trial in-process: one training step per length bucket (+ more up to --steps), one
  holdout forward per bucket, one checkpoint; `train` afterwards reports the graphs it needed that
  the trial had not traced (`graphs_not_in_compile_cache`, expected 0).
Eager backends (cpu, cuda) have nothing to compile: the step records that and exits 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import shlex
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

from . import distributed as dist_lib
from .errors import BadConfigError, RetryableError
from . import tracking
from .fileio import atomic_write_json
from .train import Trainer, add_train_args, resolve_train_config

log = logging.getLogger(__name__)

DEFAULT_NEURON_CC_FLAGS = "--target trn1 --model-type transformer --optlevel 1"


def trial_dir(run_dir: Path) -> Path:
    """A run dir that shares `prepared/` with the real one but keeps the trial's checkpoints apart."""
    trial = run_dir / "compile" / "trial"
    if trial.exists():
        shutil.rmtree(trial)
    trial.mkdir(parents=True)
    (trial / "prepared").symlink_to((run_dir / "prepared").resolve(), target_is_directory=True)
    return trial


def train_flags(args: argparse.Namespace) -> list[str]:
    """The training flags, reproduced exactly (graph identity depends on them)."""
    flags = ["--preset", args.preset, "--backend", "xla"]
    for name in ("epochs", "lr", "seed", "checkpoint_every", "log_every"):
        value = getattr(args, name)
        if value is not None:
            flags += [f"--{name.replace('_', '-')}", str(value)]
    if args.bf16:
        flags.append("--bf16")
    if args.init_from is not None:
        flags += ["--init-from", str(args.init_from)]
    return flags


def neuron_command(args: argparse.Namespace, trial: Path) -> tuple[list[str], dict[str, str]]:
    torchrun_args = shlex.split(os.environ.get("TORCHRUN_ARGS", "--standalone --nproc_per_node 32"))
    cmd = ["neuron_parallel_compile", "torchrun", *torchrun_args, "-m", "pipeline_steps", "train",
           "--run-dir", str(trial), *train_flags(args), "--max-steps", str(args.steps), "--no-progress"]
    env = dict(os.environ)
    env.setdefault("NEURON_CC_FLAGS", DEFAULT_NEURON_CC_FLAGS)
    url = dist_lib.neuron_cache_url(args.cache_url)
    if url:
        env["NEURON_COMPILE_CACHE_URL"] = url
    return cmd, env


def compile_on_neuron(args: argparse.Namespace) -> dict[str, Any]:
    if shutil.which("neuron_parallel_compile") is None:
        raise BadConfigError("neuron_parallel_compile is not on PATH: run compile inside the Neuron training image")
    cmd, env = neuron_command(args, trial_dir(args.run_dir))
    log.info("NEURON_CC_FLAGS=%s NEURON_COMPILE_CACHE_URL=%s", env["NEURON_CC_FLAGS"],
             env.get("NEURON_COMPILE_CACHE_URL", "(default local cache)"))
    log.info("running: %s", shlex.join(cmd))
    started = time.monotonic()
    result = subprocess.run(cmd, env=env, check=False)
    if result.returncode != 0:
        # Compilation failures of a graph that trained before are infrastructure (OOM, cache I/O).
        raise RetryableError(f"neuron_parallel_compile exited {result.returncode}; see the log above")
    return {"mode": "neuron_parallel_compile", "command": cmd, "neuron_cc_flags": env["NEURON_CC_FLAGS"],
            "cache_url": env.get("NEURON_COMPILE_CACHE_URL"), "seconds": time.monotonic() - started}


def compile_locally(args: argparse.Namespace) -> dict[str, Any]:
    world = dist_lib.init("xla")
    dist_lib.initialize_compile_cache(world, str(args.run_dir / "compile" / "xla_cache"))
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
    parser = argparse.ArgumentParser(prog="python -m pipeline_steps compile", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_train_args(parser)
    parser.add_argument("--steps", type=int, default=10, help="training steps in the trial (default 10)")
    parser.add_argument("--cache-url", default=os.environ.get(dist_lib.NEURON_CACHE_BASE_ENV),
                        help="Neuron persistent cache base (s3://bucket/prefix); keyed by compiler version")
    args = parser.parse_args(argv)
    backend = args.backend or dist_lib.default_backend()
    out = args.run_dir / "compile" / "compile.json"
    if backend != "xla":
        report: dict[str, Any] = {"mode": "skipped", "reason": f"backend {backend} runs eagerly: nothing to compile"}
        log.info("compile: %s", report["reason"])
    elif dist_lib.neuron_available():
        report = compile_on_neuron(args)
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
