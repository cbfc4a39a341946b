"""The two-tower embedding model and its training objective.

One BERT-style text encoder (pre-LN; post-LN when started from a pretrained BERT), mean-pooled,
serves both towers: the query tower adds an MLP, the product tower an MLP over [pooled text |
numeric features | categorical embeddings]; both return L2-normalised float32 embeddings [B, E],
and an optional aux head classifies the query embedding. `training_loss` is a symmetric InfoNCE
over in-batch negatives (+ an auxiliary cross-entropy). Architecture and presets: docs/training.md.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig, TrainConfig
from .errors import BadConfigError

INIT_STD = 0.02
"""BERT's initializer range (normal with std 0.02 for every Linear and Embedding)."""

LOSS_EPS = 1e-6
"""Floor of a weighted mean's denominator: an all-padding batch gives 0, not 0/0 = NaN."""

IGNORE_INDEX = -100
"""Class id of rows without a label (matches `torch.nn.CrossEntropyLoss`'s default)."""


def categorical_embedding_dim(cardinality: int) -> int:
    """Width of a categorical feature's embedding: fastai's rule of thumb 1.6 * n**0.56, in [4, 64].

    A pure function of the cardinality, so a checkpoint's stored ModelConfig rebuilds the same shapes.
    """
    return int(min(64, max(4, round(1.6 * cardinality**0.56))))


def _large_negative(dtype: torch.dtype) -> float:
    """The most negative finite value of `dtype`: exp() of it is exactly 0, and it stays finite.
    Masks use it with `masked_fill`, never -inf: -inf turns a fully-masked row into NaN, and
    `inf - inf` appears in bf16 softmax backward."""
    return torch.finfo(dtype).min


# ----------------------------------------------------------------------------- encoder

class SelfAttention(nn.Module):
    """Multi-head self-attention over `F.scaled_dot_product_attention` (fused kernels where the
    backend has them; XLA lowers it to plain matmuls + softmax)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.head_dim = cfg.hidden_size // cfg.num_heads
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.out = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor, key_bias: torch.Tensor) -> torch.Tensor:
        """x [B, L, H]; key_bias [B, 1, 1, L] additive (0 = attend, large negative = padding)."""
        batch, length, hidden = x.shape
        qkv = self.qkv(x).view(batch, length, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)  # each [B, heads, L, head_dim]
        attended = F.scaled_dot_product_attention(
            q, k, v, attn_mask=key_bias, dropout_p=self.dropout if self.training else 0.0
        )
        return self.out(attended.transpose(1, 2).reshape(batch, length, hidden))


class EncoderBlock(nn.Module):
    """Transformer block, pre-LN by default. Pre-LN (vs BERT's post-LN) trains stably without a
    long warmup and keeps activations well scaled in bf16; the encoder adds a final LayerNorm to
    match. Post-LN (`cfg.norm_position == "post"`, BERT's layout: LayerNorm after each residual
    add) is what a pretrained BERT's weights expect."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.post_norm = cfg.norm_position == "post"
        self.attn_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.attn = SelfAttention(cfg)
        self.ffn_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.ffn = nn.Sequential(
            nn.Linear(cfg.hidden_size, cfg.intermediate_size),
            nn.GELU(),
            nn.Linear(cfg.intermediate_size, cfg.hidden_size),
        )
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, key_bias: torch.Tensor) -> torch.Tensor:
        # A config-static branch: one graph per model, never a value-dependent one.
        if self.post_norm:
            x = self.attn_norm(x + self.dropout(self.attn(x, key_bias)))
            return self.ffn_norm(x + self.dropout(self.ffn(x)))
        x = x + self.dropout(self.attn(self.attn_norm(x), key_bias))
        return x + self.dropout(self.ffn(self.ffn_norm(x)))


class TextEncoder(nn.Module):
    """Token + learned position embeddings (no segment embeddings: one text per input),
    LayerNorm, dropout, `num_layers` blocks, final LayerNorm (pre-LN only: a post-LN block already
    ends with one), mean pooling over the mask."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.max_positions = cfg.max_positions
        # Token 0 is [PAD]; padding_idx keeps its row at zero and out of the gradient.
        self.token = nn.Embedding(cfg.vocab_size, cfg.hidden_size, padding_idx=0)
        self.position = nn.Embedding(cfg.max_positions, cfg.hidden_size)
        self.embed_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(EncoderBlock(cfg) for _ in range(cfg.num_layers))
        # Identity for post-LN: an unused LayerNorm would be a parameter without gradient (DDP error).
        self.final_norm = (nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
                           if cfg.norm_position == "pre" else nn.Identity())

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """ids int [B, L], mask int/bool [B, L] (nonzero = real token) -> pooled [B, H] (model dtype)."""
        x, keep = self.token_states(ids, mask)
        # Mean over real tokens only, so trailing padding never changes a text's embedding.
        weights = keep.to(x.dtype).unsqueeze(-1)
        return (x * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1.0)

    def token_states(self, ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token output states [B, L', H] and the real-token mask bool [B, L'] (L' <= L: eager
        inference drops trailing all-padding columns). States at padding positions are meaningless."""
        length = ids.shape[1]
        # A shape check, not a value check: static under XLA.
        if length > self.max_positions:
            raise BadConfigError(
                f"sequence length {length} exceeds the model's max_positions {self.max_positions}; "
                "use length buckets <= max_positions or a preset with a larger position table"
            )
        keep = mask != 0
        if not self.training and ids.device.type != "xla":
            ids, keep = _trim_trailing_padding(ids, keep)
            length = ids.shape[1]
        x = self.token(ids) + self.position.weight[:length]
        x = self.dropout(self.embed_norm(x))
        # Additive key-padding bias, broadcast over heads and query positions. A row with no real
        # token (a padding row) attends uniformly over its padding: finite, and masked later.
        key_bias = torch.zeros(keep.shape, dtype=x.dtype, device=x.device)
        key_bias = key_bias.masked_fill(~keep, _large_negative(x.dtype))[:, None, None, :]
        for block in self.blocks:
            x = block(x, key_bias)
        return self.final_norm(x), keep


def _trim_trailing_padding(ids: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop the columns after the batch's last real token (eager inference only).

    Inference batches are length-sorted and padded to their bucket (data.text_batches), so up to
    half of each batch can be padding the encoder would process for nothing (benchmarks/README.md:
    ~1.5x embeddings/s at the small preset). Exact: padding keys get zero attention weight and are
    excluded from the mean pool, so real tokens' outputs do not depend on them. Value-dependent
    shapes are free on eager backends but a new graph per width on XLA, hence eager only."""
    columns = keep.any(dim=0).nonzero()
    width = int(columns[-1]) + 1 if columns.numel() else 1
    return (ids, keep) if width == ids.shape[1] else (ids[:, :width], keep[:, :width])


def _head(in_features: int, cfg: ModelConfig) -> nn.Sequential:
    """A tower's head over [pooled text | features]: Linear, GELU, Dropout, Linear ("mlp"), or one
    Linear ("linear", see `_identity_on_text`)."""
    if cfg.head == "linear":
        return nn.Sequential(nn.Linear(in_features, cfg.embedding_dim))
    return nn.Sequential(nn.Linear(in_features, cfg.mlp_hidden), nn.GELU(), nn.Dropout(cfg.dropout),
                         nn.Linear(cfg.mlp_hidden, cfg.embedding_dim))


@torch.no_grad()
def _identity_on_text(head: nn.Sequential, hidden_size: int) -> None:
    """Start a linear head as [I | 0]: the pooled text passes unchanged and the explicit features
    add nothing yet, so the normalised output is the encoder's mean-pooled, normalised embedding
    (what sentence-transformers computes for a mean-pooling model) until training moves it. The
    features' columns start at zero, not random: the gradient reaches them from step 1, but
    they cannot drown the text before the model has learned what they mean."""
    linear = head[0]
    linear.weight.zero_()
    linear.weight[:, :hidden_size].copy_(torch.eye(hidden_size))
    linear.bias.zero_()


# ----------------------------------------------------------------------------- the two towers

class EmbeddingModel(nn.Module):
    """Query and product towers over one shared text encoder; see the module docstring."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.encoder = TextEncoder(cfg)
        self.query_head = _head(cfg.hidden_size, cfg)
        # One table per categorical feature; index 0 is "unknown" and is a learned vector
        # (unknown carries information, unlike padding).
        self.categorical = nn.ModuleList(
            nn.Embedding(card, categorical_embedding_dim(card)) for card in cfg.categorical_cardinalities
        )
        fused = cfg.hidden_size + cfg.num_numeric + sum(e.embedding_dim for e in self.categorical)
        self.product_head = _head(fused, cfg)
        self.classifier = nn.Linear(cfg.embedding_dim, cfg.num_classes) if cfg.num_classes > 0 else None
        self.apply(self._init_weights)
        if cfg.head == "linear":
            _identity_on_text(self.query_head, cfg.hidden_size)
            _identity_on_text(self.product_head, cfg.hidden_size)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=INIT_STD)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=INIT_STD)
            if module.padding_idx is not None:
                with torch.no_grad():
                    module.weight[module.padding_idx].zero_()
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)

    @property
    def dtype(self) -> torch.dtype:
        return self.encoder.token.weight.dtype

    def encode_queries(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """ids, mask [B, Lq] -> float32 [B, E], unit L2 norm."""
        return F.normalize(self.query_head(self.encoder(ids, mask)).float(), dim=-1)

    def encode_products(self, ids: torch.Tensor, mask: torch.Tensor, numeric: torch.Tensor,
                        categorical: torch.Tensor) -> torch.Tensor:
        """ids, mask [B, L]; numeric float [B, F]; categorical int [B, C] -> float32 [B, E], unit norm."""
        pooled = self.encoder(ids, mask)
        features = [pooled]
        # Config-static branches (never on values): F == 0 / C == 0 add nothing to the graph.
        if self.cfg.num_numeric > 0:
            features.append(numeric.to(pooled.dtype))
        features.extend(table(categorical[:, i]) for i, table in enumerate(self.categorical))
        fused = torch.cat(features, dim=-1) if len(features) > 1 else pooled
        return F.normalize(self.product_head(fused).float(), dim=-1)

    def classify(self, query_embedding: torch.Tensor) -> torch.Tensor:
        """Unit-norm query embedding [B, E] -> class logits float32 [B, num_classes]."""
        if self.classifier is None:
            raise BadConfigError("classify() needs a model built with num_classes > 0 (data with labels)")
        # A unit vector has per-component scale 1/sqrt(E); rescale to ~1 so the head's logits can
        # become confident without its weights first growing by sqrt(E).
        scaled = query_embedding * (self.cfg.embedding_dim ** 0.5)
        return self.classifier(scaled.to(self.classifier.weight.dtype)).float()

    def forward(self, query_ids: torch.Tensor, query_mask: torch.Tensor, doc_ids: torch.Tensor,
                doc_mask: torch.Tensor, numeric: torch.Tensor, categorical: torch.Tensor) -> dict[str, torch.Tensor]:
        """Both towers in one call. Training goes through forward (not the encode_* methods) so a
        DistributedDataParallel wrapper sees the call and all-reduces the gradients.

        Returns {"query": [B, E], "product": [B, E]} (+ "class_logits" [B, num_classes] with an aux head).
        """
        query = self.encode_queries(query_ids, query_mask)
        out = {"query": query, "product": self.encode_products(doc_ids, doc_mask, numeric, categorical)}
        if self.classifier is not None:
            out["class_logits"] = self.classify(query)
        return out


def count_parameters(model: nn.Module) -> int:
    """Number of trainable scalars (shared tensors counted once; works through a DDP wrapper)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


# ----------------------------------------------------------------------------- objective

def _weighted_mean(values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return (values * weights).sum() / weights.sum().clamp(min=LOSS_EPS)


def training_loss(model: nn.Module, batch: dict[str, torch.Tensor],
                  train_cfg: TrainConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Symmetric InfoNCE with in-batch negatives (+ aux_weight * cross-entropy with an aux head).

    `batch` is a TrainBatches dict (see data.py); row i's positive is product i, and per-row losses
    are averaged with the pair weights. `model` may be wrapped (DDP). Returns (loss, parts) with
    detached scalar parts "contrastive", "aux" (0 without an aux head or labels) and "accuracy"
    (in-batch top-1 of queries).
    """
    out = model(batch["query_ids"], batch["query_mask"], batch["doc_ids"], batch["doc_mask"],
                batch["numeric"], batch["categorical"])
    query, product = out["query"], out["product"]  # float32, unit norm
    size = query.shape[0]
    device = query.device

    valid = batch["row_mask"] > 0
    # Padding rows are no anchors (weight 0); with the clamped denominator (LOSS_EPS) a fully
    # padded batch gives exactly 0 with zero gradients.
    weight = batch["weight"].float() * valid.float()
    diagonal = torch.eye(size, dtype=torch.bool, device=device)
    product_index = batch["product_index"]
    duplicate = (product_index[:, None] == product_index[None, :]) & ~diagonal
    # allowed[i, j]: may candidate j appear in anchor i's softmax (same rule in both directions:
    # candidate j is a real row, not padding, and not another copy of anchor i's product, which
    # would be a false negative). The diagonal is always allowed, so every row, a padding row too,
    # has a finite log-sum-exp.
    allowed = diagonal | (valid[None, :] & ~duplicate)
    negative = _large_negative(torch.float32)

    logits = (query @ product.T) / train_cfg.temperature  # [B, B] float32; row = query, column = product
    positive = logits.diagonal()
    query_anchored = logits.masked_fill(~allowed, negative)
    product_anchored = logits.T.masked_fill(~allowed, negative)
    query_to_product = torch.logsumexp(query_anchored, dim=1) - positive
    product_to_query = torch.logsumexp(product_anchored, dim=1) - positive
    contrastive = 0.5 * (_weighted_mean(query_to_product, weight) + _weighted_mean(product_to_query, weight))

    targets = torch.arange(size, device=device)
    correct = (query_anchored.argmax(dim=1) == targets).float()
    accuracy = _weighted_mean(correct, valid.float())

    if "class_logits" in out:
        labels = batch["class_id"]
        labelled = labels != IGNORE_INDEX
        # Cross-entropy by hand with a clamped gather index: identical to F.cross_entropy(
        # ignore_index=-100), but never gathers at index -100 (out of range on some XLA lowerings).
        log_probs = F.log_softmax(out["class_logits"], dim=-1)
        nll = -log_probs.gather(1, labels.clamp(min=0).unsqueeze(1)).squeeze(1)
        aux = _weighted_mean(nll.masked_fill(~labelled, 0.0), weight * labelled.float())
        loss = contrastive + train_cfg.aux_weight * aux
    else:
        aux = torch.zeros((), device=device)
        loss = contrastive
    parts = {"contrastive": contrastive.detach(), "aux": aux.detach(), "accuracy": accuracy.detach()}
    return loss, parts
