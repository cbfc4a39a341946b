"""The optimizer and learning-rate schedule the trainer uses: AdamW with BERT's weight-decay groups
(and a learning rate of its own for the text encoder when `encoder_lr` is set), linear warm-up
then linear decay."""

from __future__ import annotations

import torch

from . import distributed as dist_lib
from .config import TrainConfig


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig, world: dist_lib.World) -> torch.optim.Optimizer:
    groups: dict[tuple[bool, bool], list[torch.nn.Parameter]] = {}
    for name, param in model.named_parameters():
        # Biases, LayerNorm and embedding tables are not decayed (BERT recipe).
        decayed = not (param.ndim < 2 or "norm" in name or "embed" in name)
        # A pretrained encoder moves slower than the heads that start new (encoder_lr < lr).
        encoder = cfg.encoder_lr is not None and name.removeprefix("module.").startswith("encoder.")
        groups.setdefault((encoder, decayed), []).append(param)
    # (encoder, decayed) in a fixed order: without encoder_lr, the two groups of before, in their order.
    order = [(False, True), (False, False), (True, True), (True, False)]
    param_groups = [{"params": groups[key], "weight_decay": cfg.weight_decay if key[1] else 0.0,
                     "lr": cfg.encoder_lr if key[0] else cfg.lr} for key in order if key in groups]
    return dist_lib.make_adamw(world, param_groups, lr=cfg.lr, betas=(0.9, 0.999), eps=1e-6)


def lr_factor(step: int, cfg: TrainConfig, total_steps: int) -> float:
    """Linear warm-up, then linear decay to 10%. Never exactly 0 or 1 after warm-up starts: on XLA
    those are 'special' scalars baked into the graph, any other value is passed as data."""
    warmup = max(1, cfg.warmup_steps)
    if step < warmup:
        return (step + 1) / (warmup + 1)
    progress = (step - warmup) / max(1, total_steps - warmup)
    return max(0.1, 1.0 - 0.9 * progress) * 0.999
