"""The benchmark: throughput as ratios that hold on any machine (every key: benchmarks/README.md).

Measures, in one process, this project's train step, loader, embedding path, checkpoints and prepare
against a well-known peer (Hugging Face BertModel, eager and traced on XLA; sentence-transformers) and
this machine's own GEMM ceiling. Warm-up first; then `repeats` rounds in which every side runs back
to back, in alternating order; each ratio is taken within a round and the median over rounds is
reported, so other jobs on the machine move both sides of a ratio together. Tests never time.

Local (from a checkout, with the `bench` extra):
        python -m benchmarks.bench --quick --out bench.json          (make bench; a few minutes)
        python -m benchmarks.bench --presets tiny --backends cpu --quick   (the smoke test)
        python -m benchmarks.bench --prepare-only --presets base --prepare-records 1100000
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import platform
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pipeline_contract import PREPARED_DIR
from pipeline_steps import checkpoint, tokenization
from pipeline_steps import distributed as dist_lib
from pipeline_steps.__main__ import configure_logging
from pipeline_steps.config import ModelConfig, get_preset
from pipeline_steps.fileio import atomic_write_json

log = logging.getLogger(__name__)

CEILING_GEMM_N = 2048
"""Side of the square fp32 GEMM whose FLOP/s is this machine's ceiling (large enough to be
compute-bound on any CPU; 17 GFLOP per call)."""
EMBED_BATCH_SIZE = 64
"""The embed step's default batch size (inference.DEFAULT_BATCH_SIZE), used for ours and the peer."""
XLA_RUN_PRESET = "tiny"
"""Preset of the full local XLA training run whose graphs are counted (CPU XLA compiles slowly)."""


@dataclass(frozen=True)
class Shape:
    """One training-step shape: rows per batch, query and product-text lengths in tokens."""

    batch: int
    query_length: int
    doc_length: int

    @property
    def tokens(self) -> int:
        return self.batch * (self.query_length + self.doc_length)


# ----------------------------------------------------------------------------- measurement helpers

def _median(values: list[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def alternate(fns: dict[str, Callable[[], Any]], *, repeats: int, warmup: int = 1) -> dict[str, list[float]]:
    """Seconds per call of each function: `warmup` untimed rounds, then `repeats` rounds in which
    every function runs once, in forward order on even rounds and reverse order on odd ones."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for i in range(repeats):
        for name in (list(fns) if i % 2 == 0 else list(reversed(fns))):
            start = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - start)
    return times


def paired_ratio(numerator_s: list[float], denominator_s: list[float]) -> float:
    """Median over rounds of denominator/numerator seconds: how many times faster `numerator` is."""
    return _median([d / n for n, d in zip(numerator_s, denominator_s)])


def machine_info(threads: int) -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {
        "cpu": cpu, "logical_cpus": os.cpu_count(), "torch_threads": threads,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "python": platform.python_version(), "platform": platform.platform(),
        "load_average_at_start": None if load is None else [round(x, 2) for x in load],
        **{k: v for k, v in dist_lib.versions().items() if v is not None},
        "transformers": _version("transformers"), "sentence-transformers": _version("sentence-transformers"),
    }


def _version(package: str) -> str | None:
    import importlib.metadata

    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def gemm_ceiling(world: dist_lib.World, n: int) -> Callable[[], float]:
    """A callable that runs one n x n fp32 GEMM on the world's device, waits for it and returns its
    FLOP count (2 n^3). On XLA the inputs are device data, so each call runs the same one-op graph."""
    a, b = torch.randn(n, n).to(world.device), torch.randn(n, n).to(world.device)
    dist_lib.mark_step(world)

    def run() -> float:
        product = torch.mm(a, b)
        dist_lib.mark_step(world)  # `product` is live here, so the graph computes it
        dist_lib.wait_device(world)
        del product
        return 2.0 * n**3

    return run


# ----------------------------------------------------------------------------- FLOP accounting

def matmul_params(cfg: ModelConfig) -> int:
    """Weights of the encoder's Linear layers (biases, norms and embedding lookups do no matmul)."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    return cfg.num_layers * (4 * h * h + 2 * h * i)


def head_params(cfg: ModelConfig) -> int:
    """Weights of both towers' MLP heads (+ aux classifier): applied once per row, not per token."""
    fused = cfg.hidden_size + cfg.num_numeric + sum(
        _cat_dim(c) for c in cfg.categorical_cardinalities)
    heads = (cfg.hidden_size + fused) * cfg.mlp_hidden + 2 * cfg.mlp_hidden * cfg.embedding_dim
    return heads + cfg.embedding_dim * cfg.num_classes


def _cat_dim(cardinality: int) -> int:
    from pipeline_steps.model import categorical_embedding_dim

    return categorical_embedding_dim(cardinality)


def train_step_flops(cfg: ModelConfig, shape: Shape, *, heads: bool = True) -> float:
    """Analytic FLOPs of one training step (forward + backward = 3 x forward), both towers:

        6 * P_matmul * (B*Lq + B*Ld)                  dense layers, every token
      + 12 * layers * H * B * (Lq^2 + Ld^2)           attention scores QK^T and weighted sum AV
      + 6 * B * P_heads                               MLP heads, once per row (ours only)

    The optimizer, softmax, LayerNorm and embedding lookups are not counted (O(params) or O(tokens*H))."""
    b = shape.batch
    dense = 6.0 * matmul_params(cfg) * shape.tokens
    attention = 12.0 * cfg.num_layers * cfg.hidden_size * b * (shape.query_length**2 + shape.doc_length**2)
    return dense + attention + (6.0 * b * head_params(cfg) if heads else 0.0)


# ----------------------------------------------------------------------------- the training step

def synthetic_batch(cfg: ModelConfig, shape: Shape, seed: int = 0) -> dict[str, torch.Tensor]:
    """A TrainBatches-style batch with every token real (no padding), so the analytic FLOPs are
    the work done; same keys, dtypes and shapes as data.TrainBatches yields."""
    g = torch.Generator().manual_seed(seed)
    b = shape.batch

    def ids(length: int) -> torch.Tensor:
        # Ids >= 5 skip the special tokens (0 = [PAD]).
        return torch.randint(5, cfg.vocab_size, (b, length), generator=g, dtype=torch.int64)

    return {
        "query_ids": ids(shape.query_length), "query_mask": torch.ones(b, shape.query_length, dtype=torch.int64),
        "doc_ids": ids(shape.doc_length), "doc_mask": torch.ones(b, shape.doc_length, dtype=torch.int64),
        "numeric": torch.zeros(b, cfg.num_numeric, dtype=torch.float32),
        "categorical": torch.zeros(b, len(cfg.categorical_cardinalities), dtype=torch.int64),
        "row_mask": torch.ones(b, dtype=torch.float32), "weight": torch.ones(b, dtype=torch.float32),
        "class_id": torch.zeros(b, dtype=torch.int64) if cfg.num_classes else torch.full((b,), -100),
        "product_index": torch.arange(b, dtype=torch.int64),
    }


XLA_BF16 = "xla_bf16"
"""The XLA step with `--bf16` (production's precision), a variant timed in the same rounds as "xla"."""


def make_trainer(run_dir: Path, preset: str, backend: str, *, bf16: bool = False):
    from pipeline_steps.trainer import Trainer

    world = dist_lib.init(backend)
    cfg = dataclasses.replace(get_preset(preset).train, stall_timeout_s=1e9, bf16=bf16)
    return Trainer(run_dir, preset, cfg, world)


def our_step(trainer, batch: dict[str, torch.Tensor], steps: int,
             host_s: list[float]) -> Callable[[], None]:
    """`steps` Trainer.train_step calls on a device batch; on XLA, waits for the last graph.
    Appends the seconds each call held the host (on XLA: tracing and dispatch) to `host_s`."""
    world = trainer.world
    device_batch = next(iter(dist_lib.device_batches(world, [batch])))

    def run() -> None:
        for _ in range(steps):
            start = time.perf_counter()
            trainer.train_step(device_batch)
            host_s.append(time.perf_counter() - start)
        dist_lib.wait_device(world)  # the last graph has run: rounds do not overlap

    return run


def peer_step(cfg: ModelConfig, shape: Shape, batch: dict[str, torch.Tensor], temperature: float,
              steps: int, world: dist_lib.World, host_s: list[float]) -> Callable[[], None]:
    """The same step in Hugging Face transformers: BertModel (sdpa attention, no pooler) shared by
    both towers, mean pooling, L2 norm, symmetric in-batch InfoNCE, grad clip 1.0, and the AdamW
    ours uses on that backend (dist_lib.make_adamw). Eager: reads the loss every step, as a loop that
    logs it does. XLA: reads nothing, one mark_step per step, as ours. Appends each step's host
    seconds to `host_s`."""
    import torch.nn.functional as F
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    bert_cfg = BertConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                          num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                          intermediate_size=cfg.intermediate_size, max_position_embeddings=cfg.max_positions,
                          hidden_dropout_prob=cfg.dropout, attention_probs_dropout_prob=cfg.dropout)
    bert_cfg._attn_implementation = "sdpa"
    model = BertModel(bert_cfg, add_pooling_layer=False).to(world.device).train()
    optimizer = dist_lib.make_adamw(world, [{"params": list(model.parameters())}], lr=1e-4, eps=1e-6,
                                    weight_decay=0.01)
    dist_lib.init_optimizer_state(world, optimizer)
    tensors = next(iter(dist_lib.device_batches(world, [batch])))
    targets = torch.arange(shape.batch, device=world.device)
    dist_lib.mark_step(world)

    def pooled(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
        weights = mask.unsqueeze(-1).to(hidden.dtype)
        return F.normalize((hidden * weights).sum(1) / weights.sum(1).clamp(min=1.0), dim=-1)

    def run() -> None:
        for _ in range(steps):
            start = time.perf_counter()
            query = pooled(tensors["query_ids"], tensors["query_mask"])
            doc = pooled(tensors["doc_ids"], tensors["doc_mask"])
            logits = query @ doc.T / temperature
            loss = 0.5 * (F.cross_entropy(logits, targets) + F.cross_entropy(logits.T, targets))
            loss.backward()
            if not world.is_xla:
                float(loss.item())  # what a loop that logs the loss every step does (free on eager CPU)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            dist_lib.optimizer_step(world, optimizer)
            optimizer.zero_grad(set_to_none=True)
            dist_lib.mark_step(world)
            host_s.append(time.perf_counter() - start)
        dist_lib.wait_device(world)  # the last graph has run: rounds do not overlap

    return run


def _counting_compiles(world: dist_lib.World, fn: Callable[[], Any], counts: list[int]) -> Callable[[], Any]:
    """`fn`, appending to `counts` the XLA graphs each call compiled."""
    def run() -> Any:
        before = dist_lib.compile_count(world)
        out = fn()
        counts.append(dist_lib.compile_count(world) - before)
        return out

    return run


def _rates(seconds: list[float], shape: Shape, steps: int, flops: float, ceilings: list[float],
           host_s: list[float]) -> dict[str, float]:
    """Medians over the paired rounds of one contender's step time, tokens/s, FLOP/s and its
    FLOP/s / the same round's GEMM FLOP/s, and of its host seconds per step."""
    achieved = [flops * steps / s for s in seconds]
    return {"step_s": _median([s / steps for s in seconds]),
            "tokens_per_s": _median([shape.tokens * steps / s for s in seconds]),
            "flops_per_s": _median(achieved), "mfu_vs_ceiling": _median([a / c for a, c in zip(achieved, ceilings)]),
            "host_s_per_step": _median(host_s)}


def bench_train(preset: str, run_dir: Path, shape: Shape, backends: list[str], eager: str, *, repeats: int,
                steps: int, ceilings: dict[str, Callable[[], float]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Per backend (and XLA_BF16 beside "xla"): tokens/s, FLOP/s, mfu, ratio to the eager peer; for
    XLA_BF16 also bf16_vs_fp32, how many times faster than "xla" in the same rounds. With XLA, also
    the peer traced on XLA and the GEMM on XLA in the same rounds (train_ratio_vs_xla_peer,
    mfu_vs_xla_ceiling), and the graphs each XLA contender compiled during the timed rounds
    (compiles_during_timing, 0 when every graph came from the warm-up). `ceilings`: the GEMM per
    backend. Returns (results, trainers by backend)."""
    trainers = {b: make_trainer(run_dir, preset, b) for b in backends}
    if "xla" in trainers:
        trainers[XLA_BF16] = make_trainer(run_dir, preset, "xla", bf16=True)
    first = next(iter(trainers.values()))
    cfg, temperature = first.model_cfg, first.cfg.temperature
    batch = synthetic_batch(cfg, shape)
    host_s: dict[str, list[float]] = {name: [] for name in (*trainers, "peer", "xla_peer")}
    fns: dict[str, Callable[[], Any]] = {"ceiling": ceilings[eager]}
    fns.update({b: our_step(t, batch, steps, host_s[b]) for b, t in trainers.items()})
    fns["peer"] = peer_step(cfg, shape, batch, temperature, steps, dist_lib.init(eager), host_s["peer"])
    xla = trainers.get("xla")
    compiles: dict[str, list[int]] = {}
    if xla is not None:
        fns["xla_peer"] = peer_step(cfg, shape, batch, temperature, steps, xla.world, host_s["xla_peer"])
        fns["xla_ceiling"] = ceilings["xla"]
        for name in ("xla", XLA_BF16, "xla_peer", "xla_ceiling"):
            fns[name] = _counting_compiles(xla.world, fns[name], compiles.setdefault(name, []))
    # XLA: the first warm-up round compiles; the second must hit the cache (checked below).
    alternate(fns, repeats=0, warmup=2 if xla else 1)
    for calls in (*host_s.values(), *compiles.values()):
        calls.clear()  # the timed rounds only
    times = alternate(fns, repeats=repeats, warmup=0)
    flops, peer_flops = train_step_flops(cfg, shape), train_step_flops(cfg, shape, heads=False)
    ceiling = [2.0 * CEILING_GEMM_N**3 / t for t in times["ceiling"]]
    results: dict[str, Any] = {
        "shape": dataclasses.asdict(shape), "tokens_per_step": shape.tokens, "flops_per_step": flops,
        "matmul_params": matmul_params(cfg), "ceiling_flops_per_s": _median(ceiling),
        "peer": _rates(times["peer"], shape, steps, peer_flops, ceiling, host_s["peer"]), "backends": {},
    }
    for backend in trainers:
        results["backends"][backend] = {**_rates(times[backend], shape, steps, flops, ceiling, host_s[backend]),
                                        "train_ratio_vs_peer": paired_ratio(times[backend], times["peer"])}
    if xla is not None:
        xla_ceiling = [2.0 * CEILING_GEMM_N**3 / t for t in times["xla_ceiling"]]
        ours = results["backends"]["xla"]
        ours["train_ratio_vs_xla_peer"] = paired_ratio(times["xla"], times["xla_peer"])
        ours["mfu_vs_xla_ceiling"] = _median([flops * steps / t / c for t, c in zip(times["xla"], xla_ceiling)])
        ours["compiles_during_timing"] = sum(compiles["xla"])
        bf16 = results["backends"][XLA_BF16]
        bf16.update(bf16_vs_fp32=paired_ratio(times[XLA_BF16], times["xla"]),
                    compiles_during_timing=sum(compiles[XLA_BF16]))
        results["xla_ceiling_flops_per_s"] = _median(xla_ceiling)
        peer = _rates(times["xla_peer"], shape, steps, peer_flops, xla_ceiling, host_s["xla_peer"])
        peer["mfu_vs_xla_ceiling"] = peer.pop("mfu_vs_ceiling")
        results["xla_peer"] = {**peer, "compiles_during_timing": sum(compiles["xla_peer"])}
        results["xla_ceiling_compiles_during_timing"] = sum(compiles["xla_ceiling"])
    return results, trainers


# ----------------------------------------------------------------------------- XLA graph accounting

def bench_xla_run(work: Path) -> dict[str, Any]:
    """A full local training run (every epoch of the tiny demo) under XLA; its XlaAccounting report."""
    from pipeline_steps.trainer import run_training

    run_dir = prepared_run_dir(work, XLA_RUN_PRESET, "xla-run")
    trainer = make_trainer(run_dir, XLA_RUN_PRESET, "xla")
    start = time.perf_counter()
    summary = run_training(trainer, progress=False)
    report = json.loads((run_dir / "train" / "xla.json").read_text())
    return {"preset": XLA_RUN_PRESET, "steps": summary["steps"], "seconds": time.perf_counter() - start,
            "graphs_compiled": report["graphs_compiled"], "compiles_after_warmup": report["compiles_after_warmup"],
            "warmup_steps": report["warmup_steps"], "batch_shapes": len(report["batch_shapes"])}


# ----------------------------------------------------------------------------- data loader

def bench_loader(trainer, step_s: float, *, min_seconds: float = 1.0) -> dict[str, Any]:
    """Batches/s of TrainBatches over whole epochs (host tensors, what the loop consumes) vs the
    train step's batches/s."""
    batches, start, epoch = 0, time.perf_counter(), 0
    while time.perf_counter() - start < min_seconds:
        for _ in trainer.batches.epoch(epoch):
            batches += 1
        epoch += 1
    produced = batches / (time.perf_counter() - start)
    consumed = 1.0 / step_s
    return {"produced_batches_per_s": produced, "consumed_batches_per_s": consumed,
            "loader_headroom": produced / consumed}


# ----------------------------------------------------------------------------- embedding inference

def _peer_encoder_dir(cfg: ModelConfig, tokenizer_path: Path, out: Path) -> Path:
    """A randomly initialised BertModel of our shape + our tokenizer, saved where
    sentence-transformers can load them (no model hub)."""
    from transformers import BertConfig, BertModel, PreTrainedTokenizerFast

    torch.manual_seed(0)
    bert_cfg = BertConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                          num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                          intermediate_size=cfg.intermediate_size, max_position_embeddings=cfg.max_positions)
    BertModel(bert_cfg, add_pooling_layer=False).save_pretrained(out)
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_path), unk_token="[UNK]", pad_token="[PAD]",
                                        cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]")
    tokenizer.save_pretrained(out)
    return out


def embed_flops(cfg: ModelConfig, lengths: np.ndarray) -> float:
    """Analytic FLOPs of the text encoder's forward pass on the real (unpadded) tokens of texts
    with these lengths: 2 * P_matmul per token (dense layers) + 4 * layers * H * L^2 per text
    (attention scores and weighted sum). Padding is work the machine does but not useful work."""
    lengths = np.asarray(lengths, dtype=np.float64)
    return float(2.0 * matmul_params(cfg) * lengths.sum() + 4.0 * cfg.num_layers * cfg.hidden_size * (lengths**2).sum())


def embed_num_texts(preset: str, quick: bool) -> int:
    """Texts per timed call: a BERT-base forward over 512 texts takes tens of seconds on 2 cores."""
    if preset in ("base", "large"):
        return 128 if quick else 512
    return 512 if quick else 2048


def _embed_peer(trainer, work: Path, texts: list[str], max_length: int, eager: str) -> Callable[[], np.ndarray]:
    """The peer's embedding call: SentenceTransformer(Transformer + mean Pooling) over a BERT of our
    encoder's shape and tokenizer, on the eager device."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.models import Pooling, Transformer

    cfg = trainer.model_cfg
    peer_dir = _peer_encoder_dir(cfg, trainer.prepared.tokenizer_path, work / f"peer-encoder-{trainer.preset}")
    transformer = Transformer(str(peer_dir), max_seq_length=max_length)
    peer_model = SentenceTransformer(modules=[transformer, Pooling(cfg.hidden_size, pooling_mode="mean")],
                                     device=eager)

    def peer() -> np.ndarray:
        return peer_model.encode(texts, batch_size=EMBED_BATCH_SIZE, normalize_embeddings=True,
                                 convert_to_numpy=True, show_progress_bar=False)

    return peer


def bench_embed(trainer, work: Path, *, num_texts: int, repeats: int, backends: list[str], eager: str,
                ceiling: Callable[[], float]) -> dict[str, Any]:
    """Ours, per backend: tokenise (as prepare does) + inference.embed_products on the checkpoint loaded
    by inference.load_for_inference. Peer: SentenceTransformer(Transformer + mean Pooling).encode with
    normalize_embeddings, on the eager device. Same texts, same batch size. The GEMM ceiling runs in
    the same rounds, so mfu_vs_ceiling = achieved FLOP/s on real tokens / the ceiling's FLOP/s."""
    from pipeline_steps.inference import embed_products, load_for_inference

    ckpt_dir = work / f"embed-checkpoint-{trainer.preset}"
    path = checkpoint.save(ckpt_dir, trainer.checkpoint_state(), keep=2)
    prepared, cfg = trainer.prepared, trainer.model_cfg
    products = prepared.products
    rows = np.arange(min(num_texts, len(products)), dtype=np.int64)
    texts = [products.texts[i] for i in rows]
    buckets = prepared.data_cfg.length_buckets
    tokenizer = tokenization.load_tokenizer(prepared.tokenizer_path)

    def ours(backend: str) -> Callable[[], np.ndarray]:
        inference = load_for_inference(path, backend)

        def run() -> np.ndarray:
            token_ids, lengths = tokenization.encode_texts(tokenizer, texts, max(buckets))
            view = dataclasses.replace(products, token_ids=token_ids, lengths=lengths,
                                       numeric=products.numeric[rows], categorical=products.categorical[rows])
            return embed_products(inference, view, np.arange(len(rows)), batch_size=EMBED_BATCH_SIZE,
                                  buckets=buckets)

        return run

    peer = _embed_peer(trainer, work, texts, max(buckets), eager)
    fns: dict[str, Callable[[], Any]] = {"ceiling": ceiling, **{b: ours(b) for b in backends}, "peer": peer}
    # XLA: the first warm-up round compiles one forward graph per length bucket.
    times = alternate(fns, repeats=repeats, warmup=2 if "xla" in backends else 1)
    real_lengths = np.minimum(products.lengths[rows], max(buckets))
    flops = embed_flops(cfg, real_lengths)
    ceilings = [2.0 * CEILING_GEMM_N**3 / t for t in times["ceiling"]]
    per_backend = {}
    for backend in backends:
        achieved = [flops / t for t in times[backend]]
        per_backend[backend] = {
            "ours_embeddings_per_s": _median([len(rows) / t for t in times[backend]]),
            "embed_ratio_vs_peer": paired_ratio(times[backend], times["peer"]),
            "flops_per_s": _median(achieved),
            "mfu_vs_ceiling": _median([a / c for a, c in zip(achieved, ceilings)]),
        }
    return {"preset": trainer.preset, "texts": len(rows), "batch_size": EMBED_BATCH_SIZE,
            "real_tokens": int(real_lengths.sum()), "buckets": list(buckets), "flops": flops,
            "ceiling_flops_per_s": _median(ceilings),
            "peer_embeddings_per_s": _median([len(rows) / t for t in times["peer"]]),
            "peer_mfu_vs_ceiling": _median([flops / t / c for t, c in zip(times["peer"], ceilings)]),
            "backends": per_backend}


# ----------------------------------------------------------------------------- checkpoints

def bench_checkpoint(trainer, work: Path, *, repeats: int) -> dict[str, Any]:
    """checkpoint.save (torch.save + fsync + sha256 + manifest) and checkpoint.load (sha256 verify +
    torch.load) of the trainer's full state (model + AdamW moments), seconds per GB."""
    state = trainer.checkpoint_state()
    ckpt_dir = work / "checkpoint-bench"
    save_s, load_s, size = [], [], 0
    for i in range(repeats):
        start = time.perf_counter()
        path = checkpoint.save(ckpt_dir, {**state, "step": i}, keep=2)
        save_s.append(time.perf_counter() - start)
        size = path.stat().st_size
        start = time.perf_counter()
        checkpoint.load(path)
        load_s.append(time.perf_counter() - start)
    gb = size / 1e9
    return {"preset": trainer.preset, "bytes": size, "save_s": _median(save_s), "load_s": _median(load_s),
            "checkpoint_save_s_per_gb": _median(save_s) / gb, "checkpoint_load_s_per_gb": _median(load_s) / gb,
            "directory_filesystem": str(work)}


# ---------------------------------------------------------------------------------------------
# Data at scale: prepare throughput and peak memory, training data memory per rank
# ---------------------------------------------------------------------------------------------

PREPARE_RECORDS = 1_000_000
"""Records (1 product : 4 pairs) of the generated JSON Lines dataset `prepare` is measured on."""


_MEASURED_STEP = ("import sys\n"
                  "from pipeline_steps.__main__ import main\n"
                  "code = main(sys.argv[1:])\n"
                  "print(next(l for l in open('/proc/self/status') if l.startswith('VmHWM:')), flush=True)\n"
                  "sys.exit(code)")
"""Runs `python -m pipeline_steps ARGS` and prints the process's own peak RSS (VmHWM, in kB) last."""


def tree_pss(pid: int) -> int:
    """Bytes of memory process `pid` and its descendants hold: the sum of their proportional set
    sizes (a page shared by k processes counts 1/k in each; /proc/PID/smaps_rollup, proc(5))."""
    total, pids = 0, [pid]
    for process in pids:  # grows as children are found
        with contextlib.suppress(OSError, StopIteration):  # a process that ended meanwhile
            for task in os.listdir(f"/proc/{process}/task"):
                pids += [int(child) for child in Path(f"/proc/{process}/task/{task}/children").read_text().split()]
            with open(f"/proc/{process}/smaps_rollup") as fh:
                total += next(int(line.split()[1]) for line in fh if line.startswith("Pss:")) * 1024
    return total


TREE_SAMPLE_S = 0.05
"""Seconds between two samples of a measured step's process tree."""


def _sample_tree_peak(proc, peak: list[int]) -> None:
    """peak[0] = the largest tree_pss of `proc` while it runs."""
    while proc.poll() is None:
        peak[0] = max(peak[0], tree_pss(proc.pid))
        time.sleep(TREE_SAMPLE_S)


def _run_measured(step_args: list[str]) -> tuple[float, float, int]:
    """(wall s, CPU s, peak memory bytes) of `python -m pipeline_steps STEP_ARGS` in a child process.

    The peak is the child's own VmHWM (/proc/self/status, read by the child as it finishes) or,
    when it has worker processes (prepare's), the largest sum of the PSS of the child and its
    workers, sampled every TREE_SAMPLE_S, whichever is larger. The rusage of the child is no good
    for it: Linux carries a parent's peak RSS into a child it forks or vforks (exec_mmap records
    the replaced address space's high-water mark in the maxrss that getrusage reports:
    https://github.com/torvalds/linux/blob/master/fs/exec.c), so a child of this 2 GB process
    would report at least 2 GB. CPU seconds are the growth of RUSAGE_CHILDREN (CPU time is not
    carried over; this child, whose workers end before it, is the only one that ends in between)."""
    import resource
    import subprocess
    import sys
    import threading

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]),
                                                                      os.environ.get("PYTHONPATH")]))}
    command = [sys.executable, "-c", _MEASURED_STEP, *step_args]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    tree_peak = [0]
    sampler = threading.Thread(target=_sample_tree_peak, args=(proc, tree_peak), daemon=True)
    sampler.start()
    stdout, stderr = proc.communicate()  # both pipes drained: a full pipe would block the child
    wall = time.perf_counter() - started
    sampler.join()
    if proc.returncode:
        raise RuntimeError(f"{' '.join(step_args)} exited {proc.returncode}: {stderr.decode(errors='replace')[-2000:]}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    hwm_kib = int(stdout.decode().strip().splitlines()[-1].split()[1])
    return wall, cpu, max(hwm_kib * 1024, tree_peak[0])


def _write_jsonl_upload(out: Path, num_records: int) -> int:
    """The demo generator's catalog and pairs, num_records in all, as JSON Lines shards."""
    import orjson

    from pipeline_steps.demo_data import generate

    products, pairs = generate(max(num_records // 5, 10), 4, seed=0)
    for kind, records in (("products", products), ("pairs", pairs)):
        (out / kind).mkdir(parents=True)
        shard = -(-len(records) // 4)
        for i in range(4):
            with open(out / kind / f"part-{i:05d}.jsonl", "wb") as fh:
                fh.writelines(orjson.dumps(r) + b"\n" for r in records[i * shard:(i + 1) * shard])
    return len(products) + len(pairs)


def _measured_prepare(upload_dir: Path, run_dir: Path, preset: str, records: int) -> dict[str, float]:
    """One `prepare` of `upload_dir` in its own process: wall and CPU seconds, records per second of
    each, its own peak RSS, and the 1-minute load average when it started."""
    load = os.getloadavg()[0]
    wall, cpu, rss = _run_measured(["prepare", "--run-dir", str(run_dir), "--data", str(upload_dir), "--preset", preset])
    return {"records": records, "wall_s": wall, "cpu_s": cpu, "records_per_s": records / wall,
            "records_per_cpu_s": records / cpu, "peak_rss_mb": rss / 2**20, "load_average_at_start": round(load, 2)}


def bench_prepare_generators(work: Path, num_records: int, preset: str) -> dict[str, Any]:
    """`prepare` of each generator's upload in benchmarks/catalogs.py (long descriptions, a large
    vocabulary, distinct queries, non-ASCII text, ...), one after the other, each deleted after."""
    import shutil

    from benchmarks.catalogs import GENERATORS, write_upload

    by_generator = {}
    for name in GENERATORS:
        upload_dir, run_dir = work / f"prepare-upload-{name}", work / f"prepare-run-{name}"
        log.info("bench prepare: %d records of the %s generator", num_records, name)
        records = write_upload(name, upload_dir, num_records)
        by_generator[name] = _measured_prepare(upload_dir, run_dir, preset, records)
        shutil.rmtree(upload_dir)
        shutil.rmtree(run_dir)
    return {"prepare_generators": by_generator,
            "prepare_generators_records_per_s": min(g["records_per_s"] for g in by_generator.values()),
            "prepare_generators_peak_rss_mb": max(g["peak_rss_mb"] for g in by_generator.values())}


def bench_prepare(work: Path, num_records: int, preset: str, generators: bool = True) -> dict[str, Any]:
    """`prepare` of a generated JSON Lines upload in its own process: records/s and peak RSS; then
    the RSS each training rank holds after loading that prepared data, with 1 and with 2 ranks;
    then (`generators`) the same measurement on the uploads of benchmarks/catalogs.py."""
    upload_dir = work / "prepare-upload"
    records = _write_jsonl_upload(upload_dir, num_records)
    run_dir = work / "prepare-run"
    single = _measured_prepare(upload_dir, run_dir, preset, records)
    ranks = [_rank_data_rss(run_dir, n) for n in (1, 2)]
    sharded = bench_prepare_sharded(work, upload_dir, run_dir, preset)
    return {"records": records, "preset": preset, "wall_s": single["wall_s"], "cpu_s": single["cpu_s"],
            "prepare_records_per_s": single["records_per_s"], "prepare_records_per_cpu_s": single["records_per_cpu_s"],
            "prepare_peak_rss_mb": single["peak_rss_mb"], "load_average_at_start": single["load_average_at_start"],
            "train_data_rss_by_ranks": ranks, "train_data_rss_mb_per_rank": ranks[-1]["private_mb"],
            "train_data_node_rss_growth": ranks[-1]["node_mb"] / ranks[0]["node_mb"], **sharded,
            **(bench_prepare_generators(work, num_records, preset) if generators else {})}


SHARDED_CHILDREN = 2
"""Array children of the sharded prepare measurement, run one after the other."""


def _phase(wall: float, cpu: float, rss: int) -> dict[str, float]:
    return {"wall_s": wall, "cpu_s": cpu, "peak_rss_mb": rss / 2**20}


def _data_file_hashes(prepared: Path) -> dict[str, str]:
    """sha256 of the files training reads and the quarantine (the Parquet pair files are cut into
    other row groups by the finish, and prepare.json records paths and times)."""
    from pipeline_steps.fileio import sha256_file

    return {f.name: sha256_file(f) for f in sorted([*prepared.glob("*.npy"), prepared / "quarantine.jsonl"])}


def bench_prepare_sharded(work: Path, upload_dir: Path, single_run_dir: Path, preset: str) -> dict[str, Any]:
    """`prepare --phase plan`, SHARDED_CHILDREN `--phase shard` children and `--phase finish` on the
    same upload, each in its own measured process: wall, CPU and peak RSS per phase (the shard
    entry is the largest over the children), the largest peak over the phases, and whether the
    data files equal the single prepare's."""
    run_dir = work / "prepare-sharded-run"
    run = ["--run-dir", str(run_dir)]
    plan = _phase(*_run_measured(["prepare", "--phase", "plan", *run, "--data", str(upload_dir), "--preset", preset]))
    children = [_phase(*_run_measured(["prepare", "--phase", "shard", *run, "--shard-index", str(i),
                                       "--shard-count", str(SHARDED_CHILDREN)])) for i in range(SHARDED_CHILDREN)]
    finish = _phase(*_run_measured(["prepare", "--phase", "finish", *run]))
    shard = {key: max(child[key] for child in children) for key in children[0]}
    phases = {"plan": plan, "shard": {**shard, "children": SHARDED_CHILDREN}, "finish": finish}
    single = _data_file_hashes(single_run_dir / PREPARED_DIR)
    return {"prepare_sharded": phases,
            "prepare_sharded_peak_rss_mb": max(p["peak_rss_mb"] for p in phases.values()),
            "prepare_sharded_identical": single == _data_file_hashes(run_dir / PREPARED_DIR)}


_RANK_PROBE = """
import sys
from pipeline_steps import distributed as dist_lib, prepared_data, static_batches

def status(key):
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(key + ":"))

world = dist_lib.init("cpu")  # joins torchrun's gloo group, as a training rank does
before = {key: status(key) for key in ("RssAnon", "RssFile")}
data = prepared_data.load_prepared(sys.argv[1])
for _ in static_batches.TrainBatches(data, data.data_cfg.batch_size, rank=world.rank, world_size=world.world_size, seed=0).epoch(0):
    pass
# One write per line: the ranks share torchrun's stdout, and print's separate newline write can interleave.
sys.stdout.write(f"rank-rss {world.rank} {status('RssAnon') - before['RssAnon']} "
                 f"{status('RssFile') - before['RssFile']}\\n")
sys.stdout.flush()
if world.world_size > 1:
    dist_lib.dist.barrier()  # every rank holds its data until all have measured
"""


def _rank_data_rss(run_dir: Path, ranks: int) -> dict[str, float]:
    """MB of RSS each of `ranks` training ranks (torchrun, gloo) adds by loading the prepared data
    and cutting one epoch of its batches: `private` (anonymous memory, what every rank pays again)
    and `shared` (pages of the memory-mapped files, held once per node in the page cache), the
    largest over the ranks; `node_mb` = the node's total. Measured in each rank after torch is
    imported, so the libraries are not counted."""
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
                          "--no-python", sys.executable, "-c", _RANK_PROBE, str(run_dir)],
                         env=env, capture_output=True, text=True, check=True)
    rows = re.findall(r"rank-rss (\d+) (-?\d+) (-?\d+)", out.stdout)
    assert len(rows) == ranks, out.stdout + out.stderr
    private, shared = [int(r[1]) / 2**20 for r in rows], [int(r[2]) / 2**20 for r in rows]
    # The node holds every rank's private pages and the mapped files once (the ranks read rows
    # spread over every file, so one rank's mapped pages stand for the node's).
    return {"ranks": ranks, "private_mb": max(private), "shared_mb": max(shared), "node_mb": sum(private) + max(shared)}


def prepared_run_dir(work: Path, preset: str, name: str | None = None) -> Path:
    """A run dir holding the preset's prepared demo data (prepared once per preset, then copied)."""
    import shutil

    from pipeline_steps.steps import prepare

    source = work / f"prepared-{preset}"
    if not (source / "prepared" / "prepare.json").exists():
        prepare.main(["--run-dir", str(source), "--demo", "--preset", preset])
    target = work / (name or f"run-{preset}")
    if not target.exists():
        shutil.copytree(source, target)
    return target


def train_shape(preset: str, quick: bool) -> Shape:
    data = get_preset(preset).data
    shape = Shape(data.batch_size, data.query_length, max(data.length_buckets))
    if quick and preset in ("base", "large"):
        # A BERT-base step at batch 32 x (32 + 128) tokens is ~3 TFLOP: tens of seconds on 2 cores.
        shape = Shape(8, data.query_length, min(data.length_buckets))
    return shape


# ----------------------------------------------------------------------------- orchestration

def _quiet_peers() -> None:
    """The peers' load reports and progress bars would bury the table."""
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def _xla_peer_headline(train: dict[str, Any], on_xla: list[str]) -> dict[str, Any]:
    """The XLA-vs-XLA-peer keys of bench.json: every preset measured on XLA must reach the target,
    so the headline ratio is the lowest; the graphs compiled while timed are summed."""
    by_preset = {p: train[p]["backends"]["xla"] for p in on_xla}
    ratios = {p: r["train_ratio_vs_xla_peer"] for p, r in by_preset.items()}
    compiles = [r["compiles_during_timing"] + train[p]["backends"][XLA_BF16]["compiles_during_timing"]
                + train[p]["xla_peer"]["compiles_during_timing"] for p, r in by_preset.items()]
    return {"xla_train_ratio_vs_xla_peer_by_preset": ratios,
            "xla_mfu_vs_xla_ceiling_by_preset": {p: r["mfu_vs_xla_ceiling"] for p, r in by_preset.items()},
            "xla_train_ratio_vs_xla_peer": min(ratios.values(), default=None),
            "xla_compiles_during_timing": sum(compiles) if on_xla else None}


def run(args: argparse.Namespace) -> dict[str, Any]:
    _quiet_peers()
    eager = "cuda" if torch.cuda.is_available() else "cpu"
    presets = [p.strip() for p in args.presets.split(",") if p.strip()]
    backends = [eager if b.strip() in ("cpu", "cuda") else b.strip() for b in args.backends.split(",") if b.strip()]
    for p in presets:
        get_preset(p)
    repeats = args.repeats or (3 if args.quick else 5)
    work = Path(tempfile.mkdtemp(prefix="bench-", dir=args.work_dir))
    result: dict[str, Any] = {"quick": args.quick, "repeats": repeats,
                              "machine": machine_info(torch.get_num_threads()), "train": {}, "notes": []}
    ceilings = {b: gemm_ceiling(dist_lib.init(b), CEILING_GEMM_N) for b in dict.fromkeys([eager, *backends])}
    trainers, step_s = _run_train_section(args, work, presets, backends, eager, repeats, ceilings, result)
    _train_headlines(result, presets[-1], eager)  # the largest preset measured (base when present)
    # ---- loader headroom against the fastest step of the smallest preset (the hardest case)
    loader = {p: bench_loader(next(iter(trainers[p].values())), step_s[p]) for p in presets}
    result["loader"] = loader
    result["loader_headroom"] = min(v["loader_headroom"] for v in loader.values())
    _run_xla_section(work, backends, result)
    _run_embed_section(args, work, presets, backends, eager, repeats, ceilings[eager], trainers, result)
    # ---- checkpoints on the largest preset's state
    result["checkpoint"] = bench_checkpoint(next(iter(trainers[presets[-1]].values())), work, repeats=repeats)
    result["checkpoint_save_s_per_gb"] = result["checkpoint"]["checkpoint_save_s_per_gb"]
    result["checkpoint_load_s_per_gb"] = result["checkpoint"]["checkpoint_load_s_per_gb"]
    # ---- data at scale: prepare of a generated JSON Lines upload, and one rank's data memory
    _run_prepare_section(args, work, presets[-1], result)
    if not args.keep_work:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    return result


def _run_train_section(args: argparse.Namespace, work: Path, presets: list[str], backends: list[str], eager: str,
                       repeats: int, ceilings: dict[str, Callable[[], float]], result: dict[str, Any],
                       ) -> tuple[dict[str, Any], dict[str, float]]:
    """The training step of every preset on every backend: (trainers by preset, fastest step by preset)."""
    step_s: dict[str, float] = {}
    trainers: dict[str, Any] = {}
    for preset in presets:
        shape = train_shape(preset, args.quick)
        if shape != train_shape(preset, quick=False):
            result["notes"].append(f"quick: {preset} at a reduced shape batch {shape.batch}, query "
                                   f"{shape.query_length}, doc {shape.doc_length} tokens")
        # One step per timed call: >= 0.1 s everywhere but tiny, and rounds stay short.
        steps = 3 if preset == "tiny" else 1
        log.info("bench train %s %s %s", preset, backends, shape)
        res, by_backend = bench_train(preset, prepared_run_dir(work, preset), shape, backends, eager,
                                      repeats=repeats, steps=steps, ceilings=ceilings)
        result["train"][preset] = res
        trainers[preset] = by_backend
        step_s[preset] = min(r["step_s"] for r in res["backends"].values())
    return trainers, step_s


def _train_headlines(result: dict[str, Any], headline: str, eager: str) -> None:
    """The headline ratios: `headline`'s on the eager device; XLA's from the first preset measured on it."""
    head = result["train"][headline]["backends"]
    result["train_ratio_vs_peer"] = head[eager]["train_ratio_vs_peer"] if eager in head else \
        max(r["train_ratio_vs_peer"] for r in head.values())
    result["mfu_vs_ceiling"] = max(r["mfu_vs_ceiling"] for r in head.values())
    result["mfu_vs_ceiling_by_preset"] = {p: {b: r["mfu_vs_ceiling"] for b, r in res["backends"].items()}
                                          for p, res in result["train"].items()}
    result["headline_preset"] = headline
    # ---- XLA: the first preset measured on it (small in the default lists)
    on_xla = [p for p, res in result["train"].items() if "xla" in res["backends"]]
    xla_head = result["train"][on_xla[0]]["backends"]["xla"] if on_xla else {}
    result["xla_preset"] = on_xla[0] if on_xla else None
    for key in ("train_ratio_vs_peer", "host_s_per_step", "tokens_per_s"):
        result[f"xla_{key}"] = xla_head.get(key)
    xla_bf16 = result["train"][on_xla[0]]["backends"][XLA_BF16] if on_xla else {}
    result["xla_bf16_tokens_per_s"] = xla_bf16.get("tokens_per_s")
    result["xla_bf16_vs_fp32"] = xla_bf16.get("bf16_vs_fp32")
    result.update(_xla_peer_headline(result["train"], on_xla))


def _run_xla_section(work: Path, backends: list[str], result: dict[str, Any]) -> None:
    """The XLA graphs of a full local training run (when XLA is measured)."""
    if "xla" in backends:
        log.info("bench xla: full local training run of the %s demo", XLA_RUN_PRESET)
        xla_run = bench_xla_run(work)
        result["xla"] = xla_run
        result["graphs_compiled"] = xla_run["graphs_compiled"]
        result["compiles_after_warmup"] = xla_run["compiles_after_warmup"]
    else:
        result["graphs_compiled"] = result["compiles_after_warmup"] = None


def _run_embed_section(args: argparse.Namespace, work: Path, presets: list[str], backends: list[str], eager: str,
                       repeats: int, ceiling: Callable[[], float], trainers: dict[str, Any],
                       result: dict[str, Any]) -> None:
    """Embedding inference, every preset on every backend; the headline is the first preset (small in
    the default list) on the eager device."""
    result["embed_by_preset"] = {}
    for preset in presets:
        log.info("bench embed %s %s", preset, backends)
        source = next(iter(trainers[preset].values()))
        result["embed_by_preset"][preset] = bench_embed(
            source, work, num_texts=embed_num_texts(preset, args.quick), repeats=repeats, backends=backends,
            eager=eager, ceiling=ceiling)
    result["embed"] = result["embed_by_preset"][presets[0]]
    head_embed = result["embed"]["backends"][eager if eager in backends else backends[0]]
    result["embed_ratio_vs_peer"] = head_embed["embed_ratio_vs_peer"]
    result["embed_mfu_vs_ceiling"] = head_embed["mfu_vs_ceiling"]


def _run_prepare_section(args: argparse.Namespace, work: Path, preset: str, result: dict[str, Any]) -> None:
    num_records = args.prepare_records or (20_000 if args.quick else PREPARE_RECORDS)
    log.info("bench prepare: %d records (%s preset)", num_records, preset)
    result["prepare"] = bench_prepare(work, num_records, preset)
    for key in (*PREPARE_TARGETS, "train_data_rss_mb_per_rank", "prepare_sharded", "prepare_sharded_peak_rss_mb",
                "prepare_sharded_identical", "prepare_generators"):
        result[key] = result["prepare"].get(key)


def run_prepare_only(args: argparse.Namespace) -> dict[str, Any]:
    """Only the data-at-scale section (`--prepare-only`): a minute or two at 1M records."""
    import shutil

    work = Path(tempfile.mkdtemp(prefix="bench-", dir=args.work_dir))
    load = os.getloadavg()
    result: dict[str, Any] = {"machine": {"logical_cpus": os.cpu_count(),
                                          "load_average_at_start": [round(x, 2) for x in load]}}
    _run_prepare_section(args, work, args.presets.split(",")[-1].strip(), result)
    if not args.keep_work:
        shutil.rmtree(work, ignore_errors=True)
    return result


PREPARE_TARGETS = {"prepare_records_per_s": (">=", 50_000.0), "prepare_peak_rss_mb": ("<=", 1536.0),
                   "prepare_generators_records_per_s": (">=", 50_000.0), "prepare_generators_peak_rss_mb": ("<=", 1536.0),
                   "train_data_node_rss_growth": ("<=", 1.25)}
"""Data at scale, on a 2-core machine: one prepare process on JSON Lines, at >= 1M records. The
last: the node's training-data RSS with 2 ranks / with 1 rank; a copy of the data per rank gives
2.0, shared memory-mapped data 1 + (a rank's index arrays / the data)."""

TARGETS = {"train_ratio_vs_peer": (">=", 1.0), "xla_train_ratio_vs_peer": (">=", 1.0),
           "xla_train_ratio_vs_xla_peer": (">=", 1.0), "xla_compiles_during_timing": ("==", 0),
           "embed_ratio_vs_peer": (">=", 1.2), "loader_headroom": (">=", 10.0), "compiles_after_warmup": ("==", 0)}


def _met(value: Any, op: str, target: float) -> str:
    if value is None:
        return "n/a"
    met = {">=": value >= target, "<=": value <= target, "==": value == target}[op]
    return "yes" if met else "NO"


def prepare_table(result: dict[str, Any]):
    """The data-at-scale rows: each figure with its goal and whether it is met."""
    from rich.table import Table

    pr = result["prepare"]
    table = Table(title=f"data at scale: prepare of {pr['records']} JSON Lines records ({pr['preset']} preset), "
                        f"training ranks under torchrun (gloo)")
    for col in ("metric", "value", "goal", "met"):
        table.add_column(col)
    generators = pr.get("prepare_generators", {})
    rows = {
        "prepare_records_per_s": f"{pr['prepare_records_per_s']:.0f} ({pr['wall_s']:.1f} s wall; "
                                 f"{pr['prepare_records_per_cpu_s']:.0f} per CPU s; load {pr['load_average_at_start']})",
        "prepare_peak_rss_mb": f"{pr['prepare_peak_rss_mb']:.0f}",
        "prepare_generators_records_per_s": f"{pr.get('prepare_generators_records_per_s') or 0:.0f} (the slowest "
                                            f"of {len(generators)} generators, below)",
        "prepare_generators_peak_rss_mb": f"{pr.get('prepare_generators_peak_rss_mb') or 0:.0f} (the largest)",
        "train_data_node_rss_growth": f"{pr['train_data_node_rss_growth']:.2f}",
    }
    for key, (op, target) in PREPARE_TARGETS.items():
        table.add_row(key, rows[key], f"{op} {target:g}", _met(pr.get(key), op, target))
    for name, g in generators.items():
        table.add_row(f"prepare of the {name} generator", f"{g['records_per_s']:.0f} records/s ({g['wall_s']:.1f} s "
                      f"wall, {g['records_per_cpu_s']:.0f} per CPU s; load {g['load_average_at_start']}), peak RSS "
                      f"{g['peak_rss_mb']:.0f} MB", "-", "-")
    for name, phase in pr["prepare_sharded"].items():
        table.add_row(f"prepare_sharded.{name}", f"{phase['wall_s']:.1f} s wall, {phase['cpu_s']:.1f} CPU s, "
                                                 f"peak RSS {phase['peak_rss_mb']:.0f} MB", "-", "-")
    op, target = PREPARE_TARGETS["prepare_peak_rss_mb"]  # the same memory goal as one prepare process
    table.add_row("prepare_sharded_peak_rss_mb", f"{pr['prepare_sharded_peak_rss_mb']:.0f}", f"{op} {target:g}",
                  _met(pr["prepare_sharded_peak_rss_mb"], op, target))
    table.add_row("prepare_sharded_identical", str(pr["prepare_sharded_identical"]).lower(), "true",
                  "yes" if pr["prepare_sharded_identical"] else "NO")
    for r in pr["train_data_rss_by_ranks"]:
        table.add_row(f"train data RSS MB per rank, {r['ranks']} rank(s)",
                      f"private {r['private_mb']:.1f}, shared (page cache) {r['shared_mb']:.1f}; "
                      f"node {r['node_mb']:.1f}", "-", "-")
    return table


def _train_rows(res: dict[str, Any]) -> list[tuple]:
    """(label, ours, ceiling FLOP/s, mfu key, peer, ratio key) per row of one preset's table: each
    backend against the eager peer, then ours on XLA against the peer traced on XLA and the GEMM on XLA."""
    rows = [(backend, r, res["ceiling_flops_per_s"], "mfu_vs_ceiling", res["peer"], "train_ratio_vs_peer")
            for backend, r in res["backends"].items()]
    if "xla_peer" in res:
        rows.append(("xla vs xla", res["backends"]["xla"], res["xla_ceiling_flops_per_s"], "mfu_vs_xla_ceiling",
                     res["xla_peer"], "train_ratio_vs_xla_peer"))
    return rows


def print_report(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(Console().width, 150))  # the tables stay readable in logs and CI
    table = Table(title="training step (median of paired rounds)")
    for col in ("preset", "backend", "batch x (q+doc)", "step s", "tokens/s", "GFLOP/s", "ceiling GFLOP/s",
                "mfu_vs_ceiling", "peer tokens/s", "ratio vs peer", "host s/step", "compiles timed"):
        table.add_column(col, justify="right")
    for preset, res in result["train"].items():
        s = res["shape"]
        for backend, r, ceiling, mfu, peer, ratio in _train_rows(res):
            table.add_row(preset, backend, f"{s['batch']} x ({s['query_length']}+{s['doc_length']})",
                          f"{r['step_s']:.3f}", f"{r['tokens_per_s']:.0f}", f"{r['flops_per_s'] / 1e9:.1f}",
                          f"{ceiling / 1e9:.1f}", f"{r[mfu]:.1%}", f"{peer['tokens_per_s']:.0f}", f"{r[ratio]:.2f}",
                          f"{r['host_s_per_step']:.3f}",
                          "-" if "compiles_during_timing" not in r else
                          f"{r['compiles_during_timing']} / peer {peer.get('compiles_during_timing', '-')}")
    console.print(table)
    summary = Table(title="targets")
    for col in ("metric", "value", "target", "met"):
        summary.add_column(col)
    for key, (op, target) in TARGETS.items():
        value = result.get(key)
        summary.add_row(key, "n/a" if value is None else f"{value:.3g}" if isinstance(value, float) else str(value),
                        f"{op} {target}", _met(value, op, target))
    summary.add_row("mfu_vs_ceiling", f"{result['mfu_vs_ceiling']:.1%}", "as high as possible", "-")
    if result.get("xla_host_s_per_step") is not None:
        summary.add_row("xla_host_s_per_step", f"{result['xla_host_s_per_step']:.3f}",
                        f"({result['xla_preset']}; tracing + dispatch, of {result['xla_tokens_per_s']:.0f} tokens/s)", "-")
    if result.get("xla_bf16_vs_fp32") is not None:
        summary.add_row("xla_bf16_vs_fp32", f"{result['xla_bf16_vs_fp32']:.2f}",
                        f"({result['xla_preset']}; {result['xla_bf16_tokens_per_s']:.0f} vs "
                        f"{result['xla_tokens_per_s']:.0f} tokens/s)", "-")
    summary.add_row("graphs_compiled", str(result.get("graphs_compiled")), "-", "-")
    summary.add_row("checkpoint_save_s_per_gb", f"{result['checkpoint_save_s_per_gb']:.2f}", "-", "-")
    summary.add_row("checkpoint_load_s_per_gb", f"{result['checkpoint_load_s_per_gb']:.2f}", "-", "-")
    summary.add_row("embed_mfu_vs_ceiling", f"{result['embed_mfu_vs_ceiling']:.1%}", "as high as possible", "-")
    console.print(summary)
    console.print(prepare_table(result))
    embed = Table(title="embedding inference (tokenisation included; FLOPs on real tokens)")
    for col in ("preset", "backend", "texts", "embeddings/s", "GFLOP/s", "ceiling GFLOP/s", "mfu_vs_ceiling",
                "peer embeddings/s", "peer mfu", "ratio vs peer"):
        embed.add_column(col, justify="right")
    for preset, e in result["embed_by_preset"].items():
        for backend, r in e["backends"].items():
            embed.add_row(preset, backend, str(e["texts"]), f"{r['ours_embeddings_per_s']:.0f}",
                          f"{r['flops_per_s'] / 1e9:.1f}", f"{e['ceiling_flops_per_s'] / 1e9:.1f}",
                          f"{r['mfu_vs_ceiling']:.1%}", f"{e['peer_embeddings_per_s']:.0f}",
                          f"{e['peer_mfu_vs_ceiling']:.1%}", f"{r['embed_ratio_vs_peer']:.2f}")
    console.print(embed)
    m = result["machine"]
    console.print(f"machine: {m['cpu']}, {m['logical_cpus']} logical CPUs, {m['torch_threads']} torch threads, "
                  f"torch {m.get('torch')}, torch-xla {m.get('torch-xla')}, load {m['load_average_at_start']}")
    for note in result["notes"]:
        console.print(f"note: {note}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="a few minutes on 2 cores: base at batch 8 x (32+64), 3 rounds")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON (bench.json)")
    parser.add_argument("--presets", default="small,base", help="comma-separated, smallest first (default small,base)")
    parser.add_argument("--backends", default="cpu,xla", help="cpu (= cuda when present) and/or xla")
    parser.add_argument("--repeats", type=int, default=0, help="paired rounds (default 3 quick, 5 full)")
    parser.add_argument("--work-dir", type=Path, default=None, help="where temporary run dirs go (default $TMPDIR)")
    parser.add_argument("--keep-work", action="store_true", help="keep the temporary run dirs")
    parser.add_argument("--prepare-records", type=int, default=0, metavar="N",
                        help=f"records of the prepare measurement (default {PREPARE_RECORDS}, 20000 with --quick)")
    parser.add_argument("--prepare-only", action="store_true",
                        help="only the data-at-scale section (prepare, training data RSS per rank), on the last "
                             "of --presets")
    args = parser.parse_args(argv)
    if args.prepare_only:
        from rich.console import Console

        result = run_prepare_only(args)
        Console(width=150).print(prepare_table(result))
    else:
        result = run(args)
        print_report(result)
    if args.out is not None:
        atomic_write_json(args.out, result)
        log.info("wrote %s", args.out)
    return 0


if __name__ == "__main__":
    configure_logging()
    sys.exit(main())
