"""The `train` step: data-parallel training of the two-tower embedding model.

Reads   DIR/prepared/ (from `prepare`), DIR/checkpoints/ (to resume), --init-from (incremental).
Writes  DIR/checkpoints/step-*.pt (+ manifest), DIR/train/metrics.jsonl (one line per step),
        DIR/train/summary.json, DIR/train/xla.json (graph accounting, xla backend).
A rerun with the same run dir resumes from the newest valid checkpoint (docs/training.md, "Resume").

Local:     python -m pipeline_steps train --run-dir runs/demo --preset tiny --backend cpu
DDP (CPU): torchrun --standalone --nproc_per_node 2 -m pipeline_steps train --run-dir runs/demo --preset tiny
XLA (CPU): PJRT_DEVICE=CPU python -m pipeline_steps train --run-dir runs/demo --preset tiny --backend xla
Trainium:  torchrun $TORCHRUN_ARGS -m pipeline_steps train --run-dir /fsx/runs/$RUN_ID --preset base --backend xla --bf16
"""

from __future__ import annotations

import argparse
import logging

from . import distributed as dist_lib, tracking
from .config import to_dict
from .contract import COMPILE_CACHE_DIR, TRAIN_METRICS
from .heartbeat import Heartbeat
from .model import count_parameters
from .trainer import Trainer, add_train_args, resolve_train_config, run_training
from .watchdog import Watchdog

log = logging.getLogger(__name__)
# The curves of the MLflow child run: streamed every log_every steps while training runs (a
# RUNNING run shows them), from values the loop already holds on the host.
STREAMED_METRICS = ("loss", "lr", "tokens_per_s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline_steps train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_train_args(parser)
    args = parser.parse_args(argv)
    cfg = resolve_train_config(args)
    world = dist_lib.init(args.backend or dist_lib.default_backend())
    try:
        if world.is_xla:
            cache = args.run_dir / COMPILE_CACHE_DIR
            if cache.exists():
                dist_lib.initialize_compile_cache(world, str(cache))
        trainer = Trainer(args.run_dir, args.preset, cfg, world, init_from=args.init_from)
        if world.is_main:
            log.info("training %s preset, %d parameters, %d steps (%d per epoch) on %s x%d",
                     args.preset, count_parameters(dist_lib.unwrap(trainer.model)), trainer.total_steps,
                     trainer.steps_per_epoch, world.backend, world.world_size)
        # The first steps compile (minutes on Neuron without a warm cache): a longer first bound.
        with Watchdog(cfg.stall_timeout_s, "training step", startup_timeout_s=2 * cfg.stall_timeout_s) as watchdog, \
                dist_lib.transient_faults_are_retryable(world, "training"):
            summary = run_training(trainer, progress=not args.no_progress,
                                   heartbeat=Heartbeat() if world.is_main else None, watchdog=watchdog,
                                   stream=tracking.MetricStream("train", args.run_dir, every=cfg.log_every,
                                                                keys=STREAMED_METRICS) if world.is_main else None)
        if world.is_main:
            log.info("done: step %d, loss %.4f, holdout loss %s, %.0f tokens/s", summary["steps"],
                     summary["final_loss"] or float("nan"), summary["holdout_loss"], summary["tokens_per_s"] or 0)
            # ---- tracking: this step as a child run of the pipeline's MLflow run (never fails the step)
            tracking.log_step(
                "train", args.run_dir, params={"preset": args.preset, "backend": world.backend,
                                               "world_size": world.world_size, "init_from": args.init_from},
                metrics=tracking.flatten(summary), config={"train": to_dict(trainer.cfg)},
                history=tracking.jsonl_history(args.run_dir / TRAIN_METRICS, STREAMED_METRICS))
    finally:
        dist_lib.shutdown()
    return 0
