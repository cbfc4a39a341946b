"""Retrieval quality on one holdout: BM25, a sentence-transformers encoder zero-shot and fine-tuned with
in-batch negatives (MultipleNegativesRankingLoss), and this pipeline from scratch and from that encoder.

    python -m benchmarks.quality --pretrained DIR --data UPLOAD --preset small --work-dir runs/quality
    python -m benchmarks.quality --pretrained DIR --demo-seed 1 --preset small --work-dir runs/quality-demo1

Every contender is scored by the same code (pipeline_steps.metrics) on the holdout `prepare` splits off
(queries never trained on), against the whole catalog. The pipeline runs are the ordinary commands with
their defaults (prepare, train, validate); sentence-transformers uses its own tokenizer and length
(max_seq_length 256) and is fine-tuned on the same training pairs for the pipeline's pretrained epochs.
Offline: set HF_HUB_OFFLINE=1. Method and figures: benchmarks/README.md, "Retrieval quality".
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pipeline_steps import data as data_lib, metrics as metrics_lib, validate
from pipeline_steps.config import PRETRAINED_TRAIN, get_preset
from pipeline_steps.fileio import atomic_write_json, read_json

log = logging.getLogger("benchmarks.quality")
KEYS = ("recall@1", "recall@10", "recall@100", "mrr", "ndcg@10")
ST_LR = 5e-5
"""transformers' TrainingArguments default, what a sentence-transformers user trains with."""
ST_WARMUP_RATIO = 0.1
"""The warm-up of the sentence-transformers training examples (sbert.net, Training Overview)."""


def _loadavg() -> list[float]:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


def _step(*args: Any) -> None:
    command = [sys.executable, "-m", "pipeline_steps", *map(str, args)]
    log.info("$ %s", " ".join(command[2:]))
    subprocess.run(command, check=True)


def prepare_runs(work: Path, upload: Path, preset: str, pretrained: Path) -> dict[str, Path]:
    """One run dir prepared from scratch and one from the pretrained encoder, on the same upload."""
    runs = {"scratch": work / "scratch", "pretrained": work / "pretrained"}
    for name, run_dir in runs.items():
        if not (run_dir / "prepared" / "prepare.json").is_file():
            start = ["--pretrained", pretrained] if name == "pretrained" else []
            _step("prepare", "--run-dir", run_dir, "--data", upload, "--preset", preset, *start)
    holdouts = [data_lib.load_prepared(r).holdout.queries for r in runs.values()]
    if holdouts[0] != holdouts[1]:
        raise SystemExit("the two prepared run dirs hold different holdouts; prepare them from the same upload")
    return runs


def pipeline_contender(run_dir: Path, preset: str) -> dict[str, Any]:
    """train + validate with the defaults (a rerun resumes or skips what the run dir holds)."""
    started, load = time.monotonic(), _loadavg()
    _step("train", "--run-dir", run_dir, "--preset", preset, "--backend", "cpu", "--no-progress")
    train_s = time.monotonic() - started
    _step("validate", "--run-dir", run_dir, "--backend", "cpu", "--no-sanity-floor", "--gate-report-only")
    report = read_json(run_dir / "validation" / "metrics.json")
    summary = read_json(run_dir / "train" / "summary.json")
    return {"metrics": report["metrics"], "bm25": report["baseline"], "train_seconds": round(train_s, 1),
            "train_steps": summary["steps"], "loadavg_before": load, "loadavg_after": _loadavg()}


def st_metrics(model: Any, prepared: Any, holdout: validate.Holdout) -> dict[str, float]:
    products = model.encode(list(prepared.products.texts), batch_size=64, normalize_embeddings=True)
    queries = model.encode(holdout.queries, batch_size=64, normalize_embeddings=True)
    ranked = metrics_lib.top_k_by_dot(torch.from_numpy(np.asarray(queries)), torch.from_numpy(np.asarray(products)),
                                      metrics_lib.RANK_DEPTH)
    return dict(metrics_lib.retrieval_metrics(ranked, holdout.relevant))


def st_finetune(pretrained: Path, prepared: Any, *, epochs: int, batch_size: int, out: Path) -> Any:
    """The standard sentence-transformers recipe: MultipleNegativesRankingLoss over (query, product
    text) pairs, in-batch negatives, batches without duplicate texts, linear schedule with warm-up."""
    from datasets import Dataset
    from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer, \
        SentenceTransformerTrainingArguments
    from sentence_transformers.losses import MultipleNegativesRankingLoss
    from sentence_transformers.training_args import BatchSamplers

    model = SentenceTransformer(str(pretrained), device="cpu", local_files_only=True)
    texts = prepared.products.texts
    pairs = Dataset.from_dict({"anchor": list(prepared.train.queries),
                               "positive": [texts[i] for i in prepared.train.product_index.tolist()]})
    args = SentenceTransformerTrainingArguments(
        output_dir=str(out), num_train_epochs=epochs, per_device_train_batch_size=batch_size, learning_rate=ST_LR,
        warmup_ratio=ST_WARMUP_RATIO, batch_sampler=BatchSamplers.NO_DUPLICATES, save_strategy="no",
        report_to="none", logging_steps=50, seed=0, use_cpu=True, dataloader_num_workers=0)
    trainer = SentenceTransformerTrainer(model=model, args=args, train_dataset=pairs,
                                         loss=MultipleNegativesRankingLoss(model))
    trainer.train()
    return model


def sentence_transformers_contenders(pretrained: Path, run_dir: Path, preset: str, work: Path) -> dict[str, Any]:
    from sentence_transformers import SentenceTransformer

    prepared = data_lib.load_prepared(run_dir)
    holdout = validate.holdout_queries(prepared.holdout)
    zero_shot = SentenceTransformer(str(pretrained), device="cpu", local_files_only=True)
    out = {"st_zero_shot": {"metrics": st_metrics(zero_shot, prepared, holdout)}}
    epochs, batch = PRETRAINED_TRAIN["epochs"], get_preset(preset).data.batch_size
    started, load = time.monotonic(), _loadavg()
    tuned = st_finetune(pretrained, prepared, epochs=epochs, batch_size=batch, out=work / "st-finetune")
    out["st_finetuned"] = {"metrics": st_metrics(tuned, prepared, holdout),
                           "train_seconds": round(time.monotonic() - started, 1), "epochs": epochs,
                           "batch_size": batch, "lr": ST_LR, "warmup_ratio": ST_WARMUP_RATIO,
                           "loadavg_before": load, "loadavg_after": _loadavg()}
    return out


def table(results: dict[str, Any]) -> str:
    encoder = Path(results["pretrained"]).name
    rows = [("BM25", results["pipeline_pretrained"]["bm25"]),
            (f"{encoder} zero-shot (sentence-transformers)", results["st_zero_shot"]["metrics"]),
            (f"{encoder} fine-tuned, MNRL (sentence-transformers)", results["st_finetuned"]["metrics"]),
            ("pipeline from scratch", results["pipeline_scratch"]["metrics"]),
            (f"pipeline from {encoder}", results["pipeline_pretrained"]["metrics"])]
    lines = ["| model | " + " | ".join(KEYS) + " |", "|---" * (len(KEYS) + 1) + "|"]
    lines += [f"| {name} | " + " | ".join(f"{m[k]:.3f}" for k in KEYS) + " |" for name, m in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.quality", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pretrained", required=True, type=Path, help="a sentence-transformers BERT folder")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--data", type=Path, help="a catalog in the upload layout (docs/data.md)")
    source.add_argument("--demo-seed", type=int, help="the bundled demo data, with this seed")
    parser.add_argument("--preset", default="small")
    parser.add_argument("--demo-size", default=None, help="the demo catalog's size by preset (default: --preset)")
    parser.add_argument("--work-dir", required=True, type=Path)
    parser.add_argument("--out", type=Path, default=None, help="default: WORK_DIR/quality.json")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # With torch-xla installed, transformers' Trainer would put sentence-transformers on the XLA device.
    os.environ.setdefault("USE_TORCH_XLA", "0")
    upload = args.data
    if upload is None:
        size = args.demo_size or args.preset
        upload = args.work_dir / f"demo-{size}-seed{args.demo_seed}"
        if not (upload / "_SUCCESS").exists():
            subprocess.run([sys.executable, "-m", "pipeline_steps.demo_data", str(upload), "--preset", size,
                            "--seed", str(args.demo_seed)], check=True)
    runs = prepare_runs(args.work_dir, upload, args.preset, args.pretrained)
    results: dict[str, Any] = {"catalog": str(upload), "preset": args.preset, "pretrained": str(args.pretrained),
                               "pretrained_defaults": PRETRAINED_TRAIN, "nproc": os.cpu_count()}
    prepared = data_lib.load_prepared(runs["pretrained"])
    results["sizes"] = {"products": len(prepared.products.ids), "train_pairs": len(prepared.train.queries),
                        "holdout_queries": len(validate.holdout_queries(prepared.holdout).queries)}
    results.update(sentence_transformers_contenders(args.pretrained, runs["pretrained"], args.preset, args.work_dir))
    for name, run_dir in runs.items():
        results[f"pipeline_{name}"] = pipeline_contender(run_dir, args.preset)
    results["table"] = table(results)
    atomic_write_json(args.out or args.work_dir / "quality.json", results)
    print(results["table"])
    print(json.dumps({k: results[k] for k in ("catalog", "sizes")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
