"""Step `export`: the trained towers as sentence-transformers folders that serving stacks load.

Writes OUT/query/, OUT/product/ (only for a model without explicit product features) and
OUT/export.json from a checkpoint (a .pt file or a run dir); OUT is replaced as a whole.
`--s3-uri` also uploads OUT (the marker _SUCCESS last); `--run-dir` closes the pipeline's MLflow run.
Folder layout, publishing and exit codes: docs/training.md, "Exporting the model".

Local:  python -m pipeline_steps export --checkpoint runs/demo --out runs/demo/export
AWS:    job "export" after Embed: python -m pipeline_steps export --run-dir /fsx/runs/<run_id>
        --checkpoint /fsx/runs/<run_id> --out /fsx/runs/<run_id>/export --s3-uri s3://<artifacts>/runs/<run_id>/export/
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from .config import ModelConfig, from_dict
from .contract import GATE_REPORT
from .errors import BadConfigError, BadInputError
from .fileio import fsync_dir, sha256_file

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
MARKER = "_SUCCESS"
"""Written last under --s3-uri: its presence means every file of the export is in S3."""
GELU = "torch.nn.modules.activation.GELU"
IDENTITY = "torch.nn.modules.linear.Identity"
PAD_ID = 0
"""The pipeline pads with token id 0; RobertaPreLayerNorm numbers positions from pad_token_id + 1."""


# ----------------------------------------------------------------------------- the encoder as transformers

def _common_config(cfg: ModelConfig) -> dict[str, Any]:
    return {
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "intermediate_size": cfg.intermediate_size, "hidden_act": "gelu",
        "hidden_dropout_prob": cfg.dropout, "attention_probs_dropout_prob": cfg.dropout, "type_vocab_size": 1,
        "layer_norm_eps": cfg.layer_norm_eps, "pad_token_id": PAD_ID, "position_embedding_type": "absolute",
        "initializer_range": 0.02, "use_cache": False,
    }


def _layer(state: dict[str, torch.Tensor], i: int, post_norm: bool) -> dict[str, torch.Tensor]:
    """One block's tensors under transformers' encoder.layer.i names (BertLayer layout)."""
    src, dst = f"blocks.{i}.", f"encoder.layer.{i}."
    out = {}
    for kind in ("weight", "bias"):
        query, key, value = state[f"{src}attn.qkv.{kind}"].chunk(3, dim=0)
        out.update({f"{dst}attention.self.query.{kind}": query, f"{dst}attention.self.key.{kind}": key,
                    f"{dst}attention.self.value.{kind}": value,
                    f"{dst}attention.output.dense.{kind}": state[f"{src}attn.out.{kind}"],
                    f"{dst}intermediate.dense.{kind}": state[f"{src}ffn.0.{kind}"],
                    f"{dst}output.dense.{kind}": state[f"{src}ffn.2.{kind}"]})
        if post_norm:  # BERT: LayerNorm after each residual add, inside the output modules
            out[f"{dst}attention.output.LayerNorm.{kind}"] = state[f"{src}attn_norm.{kind}"]
            out[f"{dst}output.LayerNorm.{kind}"] = state[f"{src}ffn_norm.{kind}"]
        else:  # RobertaPreLayerNorm: LayerNorm before attention and before the FFN
            out[f"{dst}attention.LayerNorm.{kind}"] = state[f"{src}attn_norm.{kind}"]
            out[f"{dst}intermediate.LayerNorm.{kind}"] = state[f"{src}ffn_norm.{kind}"]
    return out


def hf_encoder(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(config.json, tensors) of a stock transformers model computing the same token states as the
    TextEncoder with `state` (its state_dict). Segment embeddings are one zero row (one text per
    input); the pooler is zeros and unused (the towers mean-pool)."""
    hidden = cfg.hidden_size
    post_norm = cfg.norm_position == "post"
    positions = state["position.weight"]
    if not post_norm:
        # RobertaPreLayerNorm gives real token j the position id pad_token_id + 1 + j (row 0 = padding).
        positions = torch.cat([torch.zeros(PAD_ID + 1, hidden), positions])
    tensors = {
        "embeddings.word_embeddings.weight": state["token.weight"],
        "embeddings.position_embeddings.weight": positions,
        "embeddings.token_type_embeddings.weight": torch.zeros(1, hidden),
        "embeddings.LayerNorm.weight": state["embed_norm.weight"],
        "embeddings.LayerNorm.bias": state["embed_norm.bias"],
        "pooler.dense.weight": torch.zeros(hidden, hidden), "pooler.dense.bias": torch.zeros(hidden),
    }
    for i in range(cfg.num_layers):
        tensors.update(_layer(state, i, post_norm))
    config = {**_common_config(cfg), "max_position_embeddings": positions.shape[0]}
    if post_norm:
        config.update(model_type="bert", architectures=["BertModel"])
    else:
        tensors["LayerNorm.weight"], tensors["LayerNorm.bias"] = state["final_norm.weight"], state["final_norm.bias"]
        config.update(model_type="roberta-prelayernorm", architectures=["RobertaPreLayerNormModel"])
    return config, {k: v.detach().float().contiguous() for k, v in tensors.items()}


# ----------------------------------------------------------------------------- tokenizer files

def tokenizer_files(tokenizer_json: str, max_length: int) -> dict[str, Any]:
    """tokenizer.json (without baked-in padding/truncation: the loader sets them per call),
    tokenizer_config.json and special_tokens_map.json for transformers' PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer

    spec = json.loads(tokenizer_json)
    spec["padding"], spec["truncation"] = None, None
    tokenizer = Tokenizer.from_str(json.dumps(spec))
    specials = {"pad_token": tokenizer.id_to_token(PAD_ID)}
    unk = (spec.get("model") or {}).get("unk_token")
    if unk is not None:
        specials["unk_token"] = unk
    for key, token in (("cls_token", "[CLS]"), ("sep_token", "[SEP]"), ("mask_token", "[MASK]")):
        if tokenizer.token_to_id(token) is not None:
            specials[key] = token
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_length,
              "model_input_names": ["input_ids", "attention_mask"], "clean_up_tokenization_spaces": False,
              **specials}
    return {"tokenizer.json": spec, "tokenizer_config.json": config, "special_tokens_map.json": specials}


# ----------------------------------------------------------------------------- one tower

def _dense(directory: Path, layer: torch.nn.Linear, activation: str) -> None:
    from safetensors.torch import save_file

    directory.mkdir()
    _write_json(directory / "config.json", {"in_features": layer.in_features, "out_features": layer.out_features,
                                            "bias": True, "activation_function": activation})
    save_file({"linear.weight": layer.weight.detach().float().contiguous(),
               "linear.bias": layer.bias.detach().float().contiguous()}, str(directory / "model.safetensors"))


def write_tower(directory: Path, model: torch.nn.Module, head: torch.nn.Sequential, tokenizer_json: str,
                max_length: int) -> None:
    """A sentence-transformers folder: encoder -> mean pool -> head (each Linear a Dense) -> L2."""
    from safetensors.torch import save_file

    cfg: ModelConfig = model.cfg
    directory.mkdir(parents=True)
    config, tensors = hf_encoder(cfg, model.encoder.state_dict())
    _write_json(directory / "config.json", config)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    for name, content in tokenizer_files(tokenizer_json, max_length).items():
        _write_json(directory / name, content)
    # Texts longer than the training length were never seen: truncate exactly as prepare does.
    _write_json(directory / "sentence_bert_config.json", {"max_seq_length": max_length, "do_lower_case": False})
    _write_json(directory / "config_sentence_transformers.json", {
        "__version__": {"pytorch": torch.__version__.split("+")[0]}, "prompts": {}, "default_prompt_name": None,
        "similarity_fn_name": "cosine"})
    (directory / "1_Pooling").mkdir()
    _write_json(directory / "1_Pooling" / "config.json", {
        "word_embedding_dimension": cfg.hidden_size, "pooling_mode_cls_token": False,
        "pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False, "pooling_mode_weightedmean_tokens": False,
        "pooling_mode_lasttoken": False, "include_prompt": True})
    modules = [("", "sentence_transformers.models.Transformer"), ("1_Pooling", "sentence_transformers.models.Pooling")]
    # The head: Linear, GELU, Dropout (the identity at inference), Linear; or one Linear.
    layers = list(head)
    for i, layer in enumerate(layers):
        if isinstance(layer, torch.nn.Linear):
            followed_by_gelu = i + 1 < len(layers) and isinstance(layers[i + 1], torch.nn.GELU)
            path = f"{len(modules)}_Dense"
            _dense(directory / path, layer, GELU if followed_by_gelu else IDENTITY)
            modules.append((path, "sentence_transformers.models.Dense"))
    modules.append((f"{len(modules)}_Normalize", "sentence_transformers.models.Normalize"))
    (directory / modules[-1][0]).mkdir()
    _write_json(directory / "modules.json", [{"idx": i, "name": str(i), "path": path, "type": kind}
                                             for i, (path, kind) in enumerate(modules)])


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


# ----------------------------------------------------------------------------- the step

def export(checkpoint_or_run_dir: str | os.PathLike, out: Path) -> dict[str, Any]:
    """Write OUT (replacing it) and return export.json's content."""
    from . import checkpoint

    path = checkpoint.resolve(checkpoint_or_run_dir)
    model, state = checkpoint.load_model(path)
    cfg: ModelConfig = from_dict(ModelConfig, dict(state["config"]["model"]))
    try:
        tokenizer_json, data_cfg = state["tokenizer"]["json"], state["config"]["data"]
    except (KeyError, TypeError):
        raise BadInputError(f"checkpoint {path} stores no tokenizer or data config; export a checkpoint written by "
                            "`python -m pipeline_steps train`") from None
    query_length, product_length = int(data_cfg["query_length"]), int(max(data_cfg["length_buckets"]))
    has_features = cfg.num_numeric > 0 or len(cfg.categorical_cardinalities) > 0
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        write_tower(staging / "query", model, model.query_head, tokenizer_json, query_length)
        towers = {"query": {"path": "query", "max_seq_length": query_length}}
        if not has_features:
            write_tower(staging / "product", model, model.product_head, tokenizer_json, product_length)
            towers["product"] = {"path": "product", "max_seq_length": product_length}
        report = {
            "format_version": FORMAT_VERSION, "checkpoint": str(path), "checkpoint_sha256": sha256_file(path),
            "step": state.get("step"), "embedding_dim": cfg.embedding_dim, "towers": towers,
            "encoder": "BertModel" if cfg.norm_position == "post" else "RobertaPreLayerNormModel",
            "product_tower": "exported" if not has_features else (
                f"not exported: the product tower also reads {cfg.num_numeric} numeric and "
                f"{len(cfg.categorical_cardinalities)} categorical features; embed products with `embed`"),
        }
        _write_json(staging / "export.json", report)
        _replace_dir(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return report


def _replace_dir(new: Path, target: Path) -> None:
    """Rename `new` onto `target`; an existing `target` is moved aside first and then removed."""
    old = None
    if target.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".old", dir=target.parent))
        os.replace(target, old / target.name)
    os.replace(new, target)
    fsync_dir(target.parent)
    if old is not None:
        shutil.rmtree(old)


# ----------------------------------------------------------------------------- S3

def upload(out: Path, s3_uri: str) -> list[str]:
    """Upload every file under OUT to the prefix s3_uri (s3://bucket/prefix/), then the marker
    `_SUCCESS` last; return the keys written. The marker of an earlier attempt is deleted first, so
    a retried upload that stops half-way never leaves a marker over a mix of two attempts."""
    from botocore.exceptions import BotoCoreError, ClientError

    from . import s3

    bucket, prefix = s3.split_uri(s3_uri.rstrip("/") + "/" + MARKER)
    prefix = prefix[: -len(MARKER)]
    client = s3.client()
    keys = []
    try:
        client.delete_object(Bucket=bucket, Key=prefix + MARKER)
        for path in sorted(p for p in Path(out).rglob("*") if p.is_file()):
            key = prefix + path.relative_to(out).as_posix()
            client.upload_file(str(path), bucket, key)
            keys.append(key)
        client.put_object(Bucket=bucket, Key=prefix + MARKER, Body=b"")
    except (ClientError, BotoCoreError) as exc:
        raise s3.step_error(exc, s3_uri, "upload the export to") from exc
    keys.append(prefix + MARKER)
    log.info("export uploaded to s3://%s/%s (%d objects, %s last)", bucket, prefix, len(keys), MARKER)
    return keys


def finish_pipeline_run(run_dir: Path, report: dict[str, Any], out: Path, s3_uri: str | None) -> None:
    """The export's child run, then the pipeline's MLflow run closed as FINISHED with the gate's
    metrics (GATE_REPORT): on AWS the export is the last Batch job of a run that passed
    the gate. Tracking never fails the step."""
    from . import tracking
    from .fileio import read_json

    gate_path = Path(run_dir) / GATE_REPORT
    metrics = (read_json(gate_path).get("metrics") or {}) if gate_path.is_file() else {}
    tracking.log_step("export", Path(run_dir), params={
        "checkpoint": report["checkpoint"], "checkpoint_sha256": report["checkpoint_sha256"],
        "towers": ",".join(report["towers"]), "out": str(out), "s3_uri": s3_uri})
    tracking.log_pipeline(Path(run_dir), metrics=metrics, status="FINISHED", tags={tracking.OUTCOME_TAG: "exported"})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline_steps export", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, type=Path,
                        help="a checkpoint .pt, or a run dir (its newest valid checkpoint)")
    parser.add_argument("--out", required=True, type=Path, help="output directory (replaced)")
    parser.add_argument("--s3-uri", metavar="s3://BUCKET/PREFIX/",
                        help="also upload OUT there (files first, the marker _SUCCESS last)")
    parser.add_argument("--run-dir", type=Path,
                        help="the pipeline run this export ends: log it and close the run's MLflow run")
    args = parser.parse_args(argv)
    if args.s3_uri:
        _check_s3_prefix(args.s3_uri)
    report = export(args.checkpoint, args.out)
    log.info("exported %s (step %s) to %s: %s; %s", report["checkpoint"], report["step"], args.out,
             ", ".join(report["towers"]), report["product_tower"])
    if args.s3_uri:
        # Uploaded here, not left to the FSx auto-export to S3, which is asynchronous: with the marker
        # last, the published pointer names a complete export as soon as the job succeeded.
        upload(args.out, args.s3_uri)
    if args.run_dir is not None:
        finish_pipeline_run(args.run_dir, report, args.out, args.s3_uri)
    return 0


def _check_s3_prefix(uri: str) -> None:
    # Checked before the export, so a typo costs seconds, not a model load.
    if not uri.startswith("s3://") or not uri[len("s3://"):].partition("/")[0]:
        raise BadConfigError(f"--s3-uri {uri!r}: expected s3://bucket/prefix/ (e.g. "
                             "s3://my-artifacts/runs/<run_id>/export/)")
