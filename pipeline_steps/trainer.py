"""The trainer: model, optimizer, schedule and data of one run, its training step and its loop.

The `train` step (pipeline_steps/train.py has the commands) builds a `Trainer` and calls
`run_training`; `compile` and benchmarks/bench.py drive the same trainer. Its XLA discipline (static
shapes, one graph per step, no host read inside it) is docs/training.md, "Static shapes, measured".
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch

from . import checkpoint, data as data_lib, distributed as dist_lib, pretrained, tracking
from .config import PRETRAINED_TRAIN, DataConfig, ModelConfig, TrainConfig, from_dict, get_preset, to_dict
from .contract import PREPARED_DIR, TRAIN_DIR, TRAIN_METRICS, TRAIN_SUMMARY
from .errors import BadConfigError, NonFiniteLossError
from .fileio import append_jsonl, atomic_write_json, sha256_file
from .heartbeat import Heartbeat
from .model import EmbeddingModel, count_parameters, training_loss
from .optim import build_optimizer, lr_factor
from .progress import Progress
from .watchdog import Watchdog

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- configuration

def add_train_args(parser: argparse.ArgumentParser) -> None:
    """Flags shared by `train` and `compile` (compile must run exactly the training command)."""
    parser.add_argument("--run-dir", required=True, type=Path)
    parser.add_argument("--preset", default="tiny", help="tiny | small | base | large (default: tiny)")
    parser.add_argument("--backend", default=None, choices=dist_lib.BACKENDS,
                        help="default: xla on Trainium, cuda with a GPU, else cpu")
    parser.add_argument("--init-from", type=Path, default=None,
                        help="incremental training: a checkpoint .pt or a run dir (its newest checkpoint)")
    parser.add_argument("--epochs", type=int, default=None)
    parser.add_argument("--max-steps", type=int, default=None, help="stop after N optimizer steps (0 = all epochs)")
    parser.add_argument("--lr", type=float, default=None)
    parser.add_argument("--encoder-lr", type=float, default=None,
                        help="learning rate of the text encoder (default: --lr; a run from a pretrained "
                             "encoder has its own defaults, see docs/training.md)")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--checkpoint-every", type=int, default=None)
    parser.add_argument("--log-every", type=int, default=None)
    parser.add_argument("--bf16", action="store_true", default=None,
                        help="bfloat16 weights, fp32 optimizer state (xla backend; production's precision)")
    parser.add_argument("--stall-timeout-s", type=float, default=None,
                        help="exit with the retryable code when no step completes for this long")
    parser.add_argument("--no-progress", action="store_true", help="plain log lines even on a terminal")


def resolve_train_config(args: argparse.Namespace) -> TrainConfig:
    """The preset's TrainConfig, with PRETRAINED_TRAIN over it when the run dir was prepared with
    --pretrained, and the command's flags over both."""
    base = get_preset(args.preset).train
    if pretrained.staged_dir(args.run_dir / PREPARED_DIR) is not None:
        base = dataclasses.replace(base, **PRETRAINED_TRAIN)
        log.info("the run starts from a pretrained encoder: training defaults %s", PRETRAINED_TRAIN)
    overrides = {name: getattr(args, name) for name in (
        "epochs", "max_steps", "lr", "encoder_lr", "seed", "checkpoint_every", "log_every", "bf16", "stall_timeout_s")
        if getattr(args, name, None) is not None}
    return dataclasses.replace(base, **overrides)


def model_config_for(preset: str, prepared: data_lib.PreparedData) -> ModelConfig:
    """The preset's shape, completed with what the prepared data decides (vocab, features, classes)."""
    tokenizer = data_lib.load_tokenizer(prepared.tokenizer_path)
    # A run prepared with --pretrained takes the encoder's shape from that BERT.
    return pretrained.encoder_config(prepared.tokenizer_path.parent, dataclasses.replace(
        get_preset(preset).model,
        vocab_size=tokenizer.get_vocab_size(),
        max_positions=prepared.data_cfg.max_length,
        num_numeric=len(prepared.schema.numeric_names),
        categorical_cardinalities=prepared.schema.cardinalities,
        num_classes=len(prepared.schema.class_names),
    ))



# ----------------------------------------------------------------------------- the trainer

@dataclass
class TrainState:
    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0


@dataclass
class StepOutput:
    """One dispatched optimizer step: its number, learning rate and scalar values ("loss" and the
    loss parts). On XLA the values stay on the device until `host()` reads them."""

    step: int
    lr: float
    values: dict[str, torch.Tensor]
    _host: dict[str, float] | None = None

    def host(self) -> dict[str, float]:
        """The values as floats (waits for this step's graph). Each value is an output of the step's
        graph, so reading it is a copy; combining them first (torch.stack) would be a new graph."""
        if self._host is None:
            self._host = {k: float(v.item()) for k, v in self.values.items()}
        return self._host


@dataclass
class XlaAccounting:
    """Graphs compiled in this process, and how many after every batch shape has been stepped once."""

    world: dist_lib.World
    num_shapes: int
    seen_shapes: set = field(default_factory=set)
    at_warmup: int | None = None
    warmup_steps: int | None = None
    shapes: list = field(default_factory=list)

    def after_step(self, batch: dict[str, torch.Tensor], step: int) -> None:
        if not self.world.is_xla:
            return
        shape = tuple(batch["doc_ids"].shape)
        if shape not in self.seen_shapes:
            self.seen_shapes.add(shape)
            self.shapes.append({"query_ids": list(batch["query_ids"].shape), "doc_ids": list(shape)})
        if self.at_warmup is None and len(self.seen_shapes) >= self.num_shapes:
            self.at_warmup, self.warmup_steps = dist_lib.compile_count(self.world), step

    def report(self) -> dict[str, Any]:
        total = dist_lib.compile_count(self.world)
        return {
            "graphs_compiled": total,
            "compiles_after_warmup": None if self.at_warmup is None else total - self.at_warmup,
            "warmup_steps": self.warmup_steps,
            "batch_shapes": self.shapes,
            "graphs_not_in_compile_cache": dist_lib.compile_cache_misses(self.world),
        }


class Trainer:
    """Owns the model, optimizer, schedule and data of one run; `train`, `compile` and `bench` drive it."""

    def __init__(self, run_dir: Path, preset: str, cfg: TrainConfig, world: dist_lib.World,
                 init_from: Path | None = None) -> None:
        self.run_dir, self.preset, self.cfg, self.world = run_dir, preset, cfg, world
        self.prepared = data_lib.load_prepared(run_dir)
        self.data_cfg: DataConfig = self.prepared.data_cfg
        self.model_cfg = model_config_for(preset, self.prepared)
        self.batches = data_lib.TrainBatches(self.prepared, self.data_cfg.batch_size, rank=world.rank,
                                             world_size=world.world_size, seed=cfg.seed)
        self.holdout_batches = data_lib.TrainBatches(
            dataclasses.replace(self.prepared, train=self.prepared.holdout), self.data_cfg.batch_size,
            rank=world.rank, world_size=world.world_size, seed=cfg.seed)
        self.steps_per_epoch = self.batches.num_batches()
        planned = self.steps_per_epoch * cfg.epochs
        self.total_steps = min(planned, cfg.max_steps) if cfg.max_steps else planned
        if cfg.warmup_fraction > 0:  # a share of this run's steps, stored in checkpoints as resolved
            warmup = max(1, round(cfg.warmup_fraction * self.total_steps))
            cfg = self.cfg = dataclasses.replace(cfg, warmup_steps=warmup)
        self.tokenizer_sha = sha256_file(self.prepared.tokenizer_path)

        dist_lib.seed_everything(cfg.seed)
        model = EmbeddingModel(self.model_cfg)
        self.state = TrainState()
        resume = checkpoint.latest(run_dir)
        if resume is not None:
            self._restore(model, resume)
        elif init_from is not None:
            self._init_weights_from(model, init_from)
        else:
            pretrained.init_encoder(self.prepared.tokenizer_path.parent, model.encoder)  # no-op without one
        self.model = dist_lib.prepare_model(world, model, bf16=cfg.bf16)
        self.optimizer = build_optimizer(self.model, cfg, world)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(s, cfg, self.total_steps))
        saved = self._resume_state["optimizer"] if resume is not None else None
        dist_lib.init_optimizer_state(world, self.optimizer, saved)
        # XLA: 1 once any step's loss was non-finite; from then on every update is skipped in the
        # graph, so the weights stay those before that step until the host reads the loss and stops.
        self._halted = torch.zeros((), dtype=torch.float32, device=world.device) if world.is_xla else None
        # The state is its own small graph, not part of step 1, and the same graph when resuming:
        # the saved moments are copied in after it ran (no graph).
        dist_lib.mark_step(world)
        if saved is not None:
            dist_lib.load_optimizer_state(self.optimizer, saved)
            self.scheduler.load_state_dict(self._resume_state["scheduler"])
            self._resume_state = None  # free the CPU copy
        self.xla = XlaAccounting(world, num_shapes=len(self.batches.first_batch_per_bucket()))

    # -- weights in ----------------------------------------------------------------------------

    def _check_compatible(self, state: dict[str, Any], source: Path) -> None:
        stored = from_dict(ModelConfig, state["config"]["model"])
        if stored != self.model_cfg:
            diff = {k: (getattr(stored, k), getattr(self.model_cfg, k)) for k in to_dict(stored)
                    if getattr(stored, k) != getattr(self.model_cfg, k)}
            raise BadConfigError(
                f"{source} was trained with a different model shape {diff} (checkpoint, now); use the same "
                "--preset, and prepare the data with --init-from so the tokenizer and feature schema match")
        if state["tokenizer"]["sha256"] != self.tokenizer_sha:
            raise BadConfigError(
                f"{source} used a different tokenizer than {self.prepared.tokenizer_path}; rerun prepare "
                f"with --init-from {source} so incremental training keeps the previous tokenizer")

    def _restore(self, model: EmbeddingModel, path: Path) -> None:
        state = checkpoint.load(path)
        self._check_compatible(state, path)
        model.load_state_dict(state["model"])
        checkpoint.set_rng_state(state["rng"])
        self.state = TrainState(state["step"], state["epoch"], state["batch_in_epoch"])
        self._resume_state = state
        log.info("resuming from %s (step %d, epoch %d, batch %d)", path, self.state.step, self.state.epoch,
                 self.state.batch_in_epoch)

    def _init_weights_from(self, model: EmbeddingModel, source: Path) -> None:
        path = checkpoint.resolve(source)
        state = checkpoint.load(path)
        self._check_compatible(state, path)
        model.load_state_dict(state["model"])
        log.info("incremental training: weights from %s (its step %d)", path, state["step"])

    # -- one step --------------------------------------------------------------------------------

    def train_step(self, batch: dict[str, torch.Tensor]) -> StepOutput:
        """One optimizer step on a device batch; the loss in the output is the mean over workers.

        Eager: the loss is read and checked before the update. XLA: nothing is read on the host
        (that would stall tracing of the next step until this one ran); a non-finite loss skips
        the update on the device, and `checked_values` raises when the loop reads it."""
        dist_lib.seed_step(self.world, self.cfg.seed, self.state.step)  # dropout masks
        self.model.train()
        loss, parts = training_loss(self.model, batch, self.cfg)
        loss.backward()
        # The global mean loss: a NaN on any rank stops every rank at the same step.
        global_loss = dist_lib.all_reduce_sum(self.world, loss.detach().float()) / self.world.world_size
        out = StepOutput(self.state.step + 1, self.scheduler.get_last_lr()[0],
                         {"loss": global_loss, **{k: v.detach() for k, v in parts.items()}})
        found_inf = None
        if self._halted is not None:
            self._halted = torch.maximum(self._halted, (~torch.isfinite(global_loss)).float())
            found_inf = self._halted
        else:
            self.checked_values(out)
        # Average over workers, then clip, then step: every worker clips the same averaged
        # gradients, as DDP does (its all-reduce runs inside backward).
        dist_lib.reduce_gradients(self.world, self.optimizer)
        if self.cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        dist_lib.optimizer_step(self.world, self.optimizer, found_inf)
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        dist_lib.mark_step(self.world)
        self.state.step += 1
        return out

    def checked_values(self, out: StepOutput) -> dict[str, float]:
        """A step's values on the host; NonFiniteLossError if its loss is not finite."""
        values = out.host()
        if not math.isfinite(values["loss"]):
            raise NonFiniteLossError(
                f"loss is {values['loss']} at step {out.step} (lr {out.lr:.3g}); stopped before the optimizer "
                "step: no update from this step on was applied. Lower --lr, check the input features for "
                "extreme values, or resume from the last checkpoint")
        return values

    @torch.no_grad()
    def eval_step(self, batch: dict[str, torch.Tensor]) -> float:
        """Holdout loss of one device batch (one forward graph per length bucket)."""
        self.model.eval()
        loss, _ = training_loss(self.model, batch, self.cfg)
        dist_lib.mark_step(self.world)
        return float(loss.item())

    def eval_loss(self) -> float | None:
        """Mean holdout contrastive loss over this rank's holdout shard."""
        losses = [self.eval_step(b) for b in dist_lib.device_batches(self.world, self.holdout_batches.epoch(0))]
        return sum(losses) / len(losses) if losses else None

    # -- checkpoints -----------------------------------------------------------------------------

    def checkpoint_state(self) -> dict[str, Any]:
        model = dist_lib.unwrap(self.model)
        return {
            "format_version": checkpoint.FORMAT_VERSION,
            "step": self.state.step,
            "epoch": self.state.epoch,
            "batch_in_epoch": self.state.batch_in_epoch,
            "model": dist_lib.to_cpu(model.state_dict()),
            "optimizer": dist_lib.to_cpu(self.optimizer.state_dict()),
            "scheduler": self.scheduler.state_dict(),
            "rng": checkpoint.rng_state(),
            "config": {"preset": self.preset, "model": to_dict(self.model_cfg), "data": to_dict(self.data_cfg),
                       "train": to_dict(self.cfg)},
            "tokenizer": {"sha256": self.tokenizer_sha, "json": self.prepared.tokenizer_path.read_text("utf-8")},
            "schema": to_dict(self.prepared.schema),
            "extra": {"backend": self.world.backend, "world_size": self.world.world_size,
                      "versions": dist_lib.versions()},
        }

    def save_checkpoint(self) -> Path | None:
        """Every rank moves nothing; rank 0 copies to CPU and writes; all ranks meet afterwards."""
        path = None
        if self.world.is_main:
            path = checkpoint.save(self.run_dir, self.checkpoint_state(), keep=self.cfg.keep_checkpoints)
        dist_lib.barrier(self.world)
        return path

    # -- the loop --------------------------------------------------------------------------------

    def epochs(self) -> Iterator[tuple[int, int, dict[str, torch.Tensor]]]:
        """(epoch, index in epoch, device batch) from the resume position to the end of training."""
        epoch, start = self.state.epoch, self.state.batch_in_epoch
        if start >= self.steps_per_epoch:
            epoch, start = epoch + 1, 0
        while epoch < self.cfg.epochs:
            for offset, batch in enumerate(dist_lib.device_batches(self.world, self.batches.epoch(epoch, start))):
                yield epoch, start + offset, batch
            epoch, start = epoch + 1, 0


def run_training(trainer: Trainer, *, progress: bool = True, heartbeat: Heartbeat | None = None,
                 watchdog: Watchdog | None = None, stream: tracking.MetricStream | None = None) -> dict[str, Any]:
    """Train to the end (or max_steps), checkpointing every N steps and at the end.

    `heartbeat` (rank 0) prints the CloudWatch EMF progress line the stuck-job alarm watches;
    `watchdog` is told after every completed step and ends the process (exit 75) on a stall;
    `stream` (rank 0) sends the step record (host values only) to the MLflow child run."""
    cfg, world = trainer.cfg, trainer.world
    out_dir = trainer.run_dir / TRAIN_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    metrics_path = trainer.run_dir / TRAIN_METRICS
    t_start = last = time.monotonic()
    first_step = trainer.state.step
    if first_step >= trainer.total_steps:
        log.info("already trained to step %d; nothing to do", first_step)
    with Progress(trainer.total_steps, "train", log_every=cfg.log_every, enabled=world.is_main,
                  live=None if progress else False, start_step=first_step) as bar:

        def log_step(out: StepOutput, record: dict[str, Any]) -> None:
            """Read a dispatched step's values (raises on a non-finite loss) and report them."""
            record.update(trainer.checked_values(out))
            if world.is_main:
                append_jsonl(metrics_path, record)
                bar.update(out.step, loss=record["loss"], tokens_per_s=record["tokens_per_s"])
                if heartbeat is not None:
                    heartbeat.emit(step=out.step, loss=record["loss"], tokens_per_s=record["tokens_per_s"],
                                   epoch=record["epoch"])
                if stream is not None:
                    stream.log(out.step, record)
            if watchdog is not None:
                watchdog.beat()

        pending = None  # the previous step, logged once this one is dispatched
        for epoch, index, batch in trainer.epochs():
            if trainer.state.step >= trainer.total_steps:
                break
            out = trainer.train_step(batch)
            trainer.state.epoch, trainer.state.batch_in_epoch = epoch, index + 1
            trainer.xla.after_step(batch, trainer.state.step)
            now = time.monotonic()
            tokens = batch["query_ids"].numel() + batch["doc_ids"].numel()
            record = {"step": out.step, "epoch": epoch, "lr": out.lr,
                      "tokens_per_s": tokens * world.world_size / max(now - last, 1e-9),
                      "step_s": now - last, "elapsed_s": now - t_start}
            last = now
            # The previous step's graph has run (or is about to): reading it does not stall this one.
            if pending is not None:
                log_step(*pending)
            pending = (out, record)
            if trainer.state.step % cfg.checkpoint_every == 0 or trainer.state.step == trainer.total_steps:
                log_step(*pending)  # never checkpoint past a loss nobody has checked
                pending = None
                trainer.save_checkpoint()
        if pending is not None:
            log_step(*pending)
    if _latest_step(trainer.run_dir) != trainer.state.step:
        trainer.save_checkpoint()
    # Graph accounting before the holdout pass below (its forward graphs are traced by `compile`
    # too, but they are not part of the training loop's steady state).
    xla_report = trainer.xla.report() if world.is_xla else None
    elapsed = time.monotonic() - t_start
    steps_done = trainer.state.step - first_step
    summary = {
        "steps": trainer.state.step, "steps_this_run": steps_done, "total_steps": trainer.total_steps,
        "seconds": elapsed, "backend": world.backend, "world_size": world.world_size,
        "parameters": count_parameters(dist_lib.unwrap(trainer.model)),
        "final_loss": _last_loss(metrics_path), "holdout_loss": trainer.eval_loss(),
        "tokens_per_s": _mean_tokens_per_s(metrics_path, skip=2),
        "checkpoint": str(checkpoint.latest(trainer.run_dir)),
    }
    if xla_report is not None:
        summary["xla"] = xla_report
    if world.is_main:
        atomic_write_json(trainer.run_dir / TRAIN_SUMMARY, summary)
        if world.is_xla:
            atomic_write_json(out_dir / "xla.json", summary["xla"])
    return summary


def _latest_step(run_dir: Path) -> int:
    path = checkpoint.latest(run_dir)
    return -1 if path is None else checkpoint.step_of(path)


def _read_metrics(path: Path) -> list[dict[str, Any]]:
    import json

    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text("utf-8").splitlines() if line.strip()]


def _last_loss(path: Path) -> float | None:
    rows = _read_metrics(path)
    return rows[-1]["loss"] if rows else None


def _mean_tokens_per_s(path: Path, skip: int) -> float | None:
    """Throughput after the first `skip` steps (which include compilation on XLA)."""
    rows = _read_metrics(path)[skip:]
    if not rows:
        return None
    return sum(r["tokens_per_s"] for r in rows) / len(rows)
