"""prepare: validate the input records, train (or reuse) the tokenizer, split a holdout by
query, and write the pre-tokenised static-shape inputs of training, validation and inference to
RUN_DIR/prepared/ (files and formats: docs/data.md, "Outputs"; prepare.json is written last).

Exit codes: 0 ok; 65 a missing or empty input, or more than --max-bad-fraction quarantined;
75 the upload is still incomplete on FSx after --upload-timeout; 78 a bad flag value.

Local:  python -m pipeline_steps prepare --run-dir runs/demo --demo --preset tiny
AWS:    --phase plan, then --phase shard on every child of an array job, then --phase finish
        (pipeline_steps/prepare_shards.py): the same outputs, the work spread over the children.
Memory: the catalog plus one chunk of pairs (docs/data.md, "Scale").
"""

from __future__ import annotations

import argparse
from pathlib import Path

from .. import prepare_shards, tracking
from ..config import get_preset
from ..preparing import prepare


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m pipeline_steps prepare",
                                     description="Validate records, train the tokenizer, write static-shape inputs.")
    parser.add_argument("--run-dir", type=Path, required=True)
    source = parser.add_mutually_exclusive_group()  # required, except by --phase shard / finish
    source.add_argument("--data", type=Path, help="directory holding products*/ and pairs* (the upload layout)")
    source.add_argument("--products", type=Path, help="products file or directory of shards (with --pairs)")
    source.add_argument("--demo", action="store_true", help="generate the bundled demo data into RUN_DIR/input/")
    parser.add_argument("--pairs", type=Path, help="pairs file or directory of shards (with --products)")
    parser.add_argument("--preset", default="tiny", help="sets buckets, query length, vocabulary size, demo size")
    parser.add_argument("--init-from", type=Path,
                        help="previous run dir or checkpoint .pt: reuse its tokenizer + schema")
    parser.add_argument("--pretrained", type=Path,
                        help="Hugging Face BERT dir (config.json, model.safetensors, tokenizer.json): keep its "
                             "tokenizer; train starts the encoder from its weights")
    parser.add_argument("--max-bad-fraction", type=float, help="override the preset's quarantine threshold")
    parser.add_argument("--seed", type=int, default=0, help="holdout split (and demo data) seed")
    parser.add_argument("--upload-timeout", type=float, default=0.0, metavar="SECONDS",
                        help="with --data on FSx: wait up to this long for every file of the upload (listed in "
                             "its _SUCCESS manifest) to be imported, then exit 75 (retryable); 0 = local data")
    parser.add_argument("--phase", choices=("plan", "shard", "finish"),
                        help="prepare as an AWS Batch array job (docs/data.md, Scale): plan (inputs, catalog, "
                             "tokenizer, units of the pairs), shard (one array child's units), finish (the "
                             "outputs and prepare.json); default: everything in this process")
    parser.add_argument("--shard-index", type=int, help="--phase shard: default $AWS_BATCH_JOB_ARRAY_INDEX or 0")
    parser.add_argument("--shard-count", type=int,
                        help="--phase shard: the array size (default $AWS_BATCH_JOB_ARRAY_SIZE or 1); "
                             "--phase finish: names the shards to rerun when units are missing")
    args = parser.parse_args(argv)
    if args.phase in (None, "plan") and not (args.data or args.products or args.demo):
        parser.error("one of the arguments --data --products --demo is required")
    if args.phase not in ("shard", "finish") and (args.shard_index, args.shard_count) != (None, None):
        parser.error("--shard-index/--shard-count go with --phase shard (or finish)")
    if (args.products is None) != (args.pairs is None):
        parser.error("--products and --pairs go together (and not with --data/--demo)")
    if args.init_from is not None and args.pretrained is not None:
        parser.error("--init-from continues a trained model (its tokenizer and weights); --pretrained starts "
                     "from a Hugging Face encoder: pass one of them")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    preset = get_preset(args.preset)
    if args.phase is not None:
        report = prepare_shards.run_phase(args, preset)
        if args.phase != "finish":  # the plan and the array children report through the finish
            return 0
    else:
        report = prepare(args, preset)
    # ---- tracking: this step as a child run of the pipeline's MLflow run (never fails the step).
    # After prepare() returned, so its data is freed before tracking imports mlflow.
    tracking.log_step("prepare", args.run_dir, params={"preset": report["preset"], "seed": report["seed"]},
                      metrics=tracking.flatten(report), config={"data": report["data_config"]})
    return 0
