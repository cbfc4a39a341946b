"""Typed configuration of the steps: model shape, data shapes, training hyper-parameters, presets.

Frozen, keyword-only dataclasses. `PRESETS` names complete configurations: `tiny` is what tests use
(seconds on one CPU core), `small` the demo, `base` the BERT-base shape (~110M parameters), `large`
the BERT-large shape. CLI flags override single fields at the edge (`dataclasses.replace`), and the
resolved configuration is stored in every checkpoint, so a checkpoint rebuilds its own model.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from .errors import BadConfigError


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Shape of the text encoder and the fusion MLP."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_positions: int
    """Longest sequence the position table covers; >= the largest length bucket."""
    embedding_dim: int
    """Size of the L2-normalised output embedding (what the embed step writes)."""
    mlp_hidden: int
    """Hidden width of the fusion MLP (pooled text + explicit features -> embedding)."""
    dropout: float = 0.1
    # Data-derived fields, filled from the prepared schema by the train step (0 / () = absent).
    num_numeric: int = 0
    """Number of explicit numeric features fed to the product tower."""
    categorical_cardinalities: tuple[int, ...] = ()
    """Vocabulary size of each explicit categorical feature (index 0 = unknown)."""
    num_classes: int = 0
    """Classes of the optional auxiliary head (query -> product category); 0 disables it."""
    norm_position: str = "pre"
    """Where each encoder block's LayerNorms sit: "pre" (before attention/FFN, plus a final
    LayerNorm; trains stably from scratch) or "post" (after each residual add, as in BERT; set
    when the encoder starts from a pretrained BERT checkpoint, see pipeline_steps/pretrained.py)."""
    layer_norm_eps: float = 1e-5
    """LayerNorm epsilon; a pretrained encoder keeps its own (BERT: 1e-12)."""
    head: str = "mlp"
    """The towers' heads: "mlp" (Linear, GELU, Linear; trains from scratch) or "linear" (one Linear
    that starts as the identity on the pooled text and zero on the explicit features, so a model
    started from a pretrained encoder embeds exactly as that encoder does before its first step;
    needs embedding_dim == hidden_size)."""

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise BadConfigError(
                f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}; "
                "pick a head count that divides the hidden size"
            )
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "intermediate_size",
                     "max_positions", "embedding_dim", "mlp_hidden"):
            if getattr(self, name) < 1:
                raise BadConfigError(f"model.{name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.dropout < 1.0:
            raise BadConfigError(f"model.dropout must be in [0, 1), got {self.dropout}")
        if self.norm_position not in ("pre", "post"):
            raise BadConfigError(f"model.norm_position must be 'pre' or 'post', got {self.norm_position!r}")
        if not 0.0 < self.layer_norm_eps < 1.0:
            raise BadConfigError(f"model.layer_norm_eps must be in (0, 1), got {self.layer_norm_eps}")
        if self.head not in ("mlp", "linear"):
            raise BadConfigError(f"model.head must be 'mlp' or 'linear', got {self.head!r}")
        if self.head == "linear" and self.embedding_dim != self.hidden_size:
            raise BadConfigError(f"model.head 'linear' starts as the identity, so embedding_dim ({self.embedding_dim}) "
                                 f"must equal hidden_size ({self.hidden_size})")
        object.__setattr__(self, "categorical_cardinalities", tuple(self.categorical_cardinalities))


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """How records become static-shape batches."""

    batch_size: int
    """Rows per batch per rank; fixed (the last partial batch is padded with masked rows)."""
    length_buckets: tuple[int, ...]
    """Allowed product-text lengths in tokens; each batch uses one bucket (one XLA graph per bucket)."""
    query_length: int
    """Fixed query length in tokens."""
    vocab_size: int
    """Target vocabulary of the tokenizer trained by `prepare`."""
    holdout_fraction: float = 0.1
    """Share of queries held out for validation (split by query text, so no query leaks)."""
    max_bad_fraction: float = 0.01
    """`prepare` fails when more than this share of records is quarantined."""
    max_text_chars: int = 4096
    """Records with a longer title/description/query are absurd and quarantined."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "length_buckets", tuple(sorted(self.length_buckets)))
        if self.batch_size < 2:
            raise BadConfigError(f"batch_size must be >= 2 for in-batch negatives, got {self.batch_size}")
        if not self.length_buckets or min(self.length_buckets) < 4:
            raise BadConfigError(f"length_buckets must be non-empty and >= 4 tokens, got {self.length_buckets}")
        if self.query_length < 4:
            raise BadConfigError(f"query_length must be >= 4 tokens, got {self.query_length}")
        if not 0.0 < self.holdout_fraction < 0.9:
            raise BadConfigError(f"holdout_fraction must be in (0, 0.9), got {self.holdout_fraction}")
        if not 0.0 <= self.max_bad_fraction <= 1.0:
            raise BadConfigError(f"max_bad_fraction must be in [0, 1], got {self.max_bad_fraction}")

    @property
    def max_length(self) -> int:
        return max(max(self.length_buckets), self.query_length)


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Optimisation and the run's bookkeeping."""

    epochs: int = 1
    max_steps: int = 0
    """Stop after this many optimizer steps (0 = run all epochs)."""
    lr: float = 5e-4
    encoder_lr: float | None = None
    """Learning rate of the text encoder's weights (None: `lr`, as for every other weight). A
    pretrained encoder takes a smaller one than the new heads (PRETRAINED_TRAIN)."""
    weight_decay: float = 0.01
    warmup_steps: int = 10
    warmup_fraction: float = 0.0
    """When > 0, the warm-up is this share of the run's steps (the trainer sets warmup_steps from it)."""
    grad_clip: float = 1.0
    temperature: float = 0.05
    """Softmax temperature of the in-batch contrastive loss."""
    aux_weight: float = 0.2
    """Weight of the auxiliary classification loss (when the data has labels)."""
    seed: int = 0
    bf16: bool = False
    """Cast the model to bfloat16 on XLA (Trainium's native type); eager backends stay fp32."""
    checkpoint_every: int = 100
    keep_checkpoints: int = 3
    log_every: int = 10
    stall_timeout_s: float = 1800.0
    """Watchdog: exit with the retryable code when no step completes for this long (M5: 30 min)."""

    def __post_init__(self) -> None:
        if self.epochs < 1:
            raise BadConfigError(f"epochs must be >= 1, got {self.epochs}")
        if self.max_steps < 0:
            raise BadConfigError(f"max_steps must be >= 0, got {self.max_steps}")
        if self.lr <= 0 or (self.encoder_lr is not None and self.encoder_lr <= 0):
            raise BadConfigError(f"lr and encoder_lr must be > 0, got {self.lr} and {self.encoder_lr}")
        if not 0.0 <= self.warmup_fraction < 1.0:
            raise BadConfigError(f"warmup_fraction must be in [0, 1), got {self.warmup_fraction}")
        if self.checkpoint_every < 1:
            raise BadConfigError(f"checkpoint_every must be >= 1, got {self.checkpoint_every}")
        if self.keep_checkpoints < 2:
            raise BadConfigError(
                f"keep_checkpoints must be >= 2 (a corrupt latest checkpoint falls back to the one "
                f"before), got {self.keep_checkpoints}"
            )
        if self.temperature <= 0:
            raise BadConfigError(f"temperature must be > 0, got {self.temperature}")


@dataclass(frozen=True, kw_only=True)
class Preset:
    name: str
    model: ModelConfig
    data: DataConfig
    train: TrainConfig = field(default_factory=TrainConfig)
    demo_products: int = 400
    """Catalog size of the bundled demo data at this preset."""
    demo_queries_per_product: int = 4


def _preset(name: str, *, vocab: int, hidden: int, layers: int, heads: int, ffn: int, emb: int,
            buckets: tuple[int, ...], query_len: int, batch: int, train: TrainConfig,
            demo_products: int, demo_qpp: int) -> Preset:
    data = DataConfig(batch_size=batch, length_buckets=buckets, query_length=query_len, vocab_size=vocab)
    model = ModelConfig(vocab_size=vocab, hidden_size=hidden, num_layers=layers, num_heads=heads,
                        intermediate_size=ffn, max_positions=data.max_length, embedding_dim=emb,
                        mlp_hidden=max(emb, hidden))
    return Preset(name=name, model=model, data=data, train=train,
                  demo_products=demo_products, demo_queries_per_product=demo_qpp)


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        _preset("tiny", vocab=1024, hidden=64, layers=2, heads=2, ffn=128, emb=32, buckets=(16, 32),
                query_len=16, batch=16, demo_products=240, demo_qpp=3,
                train=TrainConfig(epochs=2, lr=2e-3, warmup_steps=5, checkpoint_every=20, log_every=5)),
        _preset("small", vocab=4096, hidden=256, layers=4, heads=4, ffn=1024, emb=128, buckets=(32, 64),
                query_len=16, batch=32, demo_products=1500, demo_qpp=6,
                train=TrainConfig(epochs=4, lr=5e-4, warmup_steps=30, checkpoint_every=100, log_every=10)),
        _preset("base", vocab=30522, hidden=768, layers=12, heads=12, ffn=3072, emb=256, buckets=(64, 128),
                query_len=32, batch=32, demo_products=5000, demo_qpp=8,
                train=TrainConfig(epochs=3, lr=1e-4, warmup_steps=100, checkpoint_every=500, log_every=20)),
        _preset("large", vocab=30522, hidden=1024, layers=24, heads=16, ffn=4096, emb=256, buckets=(64, 128),
                query_len=32, batch=32, demo_products=5000, demo_qpp=8,
                train=TrainConfig(epochs=3, lr=5e-5, warmup_steps=200, checkpoint_every=500, log_every=20)),
    )
}


PRETRAINED_TRAIN: dict[str, Any] = {
    "lr": 1e-3, "encoder_lr": 5e-5, "warmup_fraction": 0.1, "epochs": 2, "temperature": 0.05,
}
"""What a run started from a pretrained encoder trains with instead of the preset's TrainConfig
fields (flags still override): see docs/training.md, "Starting from a pretrained encoder"."""


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise BadConfigError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}") from None


def to_dict(obj: Any) -> dict[str, Any]:
    """A JSON-able dict of a config dataclass (tuples become lists)."""
    return dataclasses.asdict(obj)


def from_dict(cls: type, values: dict[str, Any]):
    """Rebuild a config dataclass from `to_dict` output, rejecting unknown keys with a clear error."""
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(values) - names
    if unknown:
        raise BadConfigError(f"unknown {cls.__name__} fields {sorted(unknown)}; was this written by a newer version?")
    fixed = {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}
    return cls(**fixed)
