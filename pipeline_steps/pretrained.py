"""Start the text encoder from a local Hugging Face BERT directory (nothing is downloaded).

The directory holds config.json (model_type "bert"), model.safetensors and tokenizer.json.
`prepare --pretrained DIR` checks it, keeps its tokenizer and copies config + weights to
RUN_DIR/prepared/pretrained/; `train` then builds the encoder in BERT's shape and loads those weights
(`encoder_config`, `init_encoder`). What is kept, what starts new, what is refused: docs/training.md.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .config import ModelConfig
from .contract import PREPARED_DIR
from .errors import BadConfigError
from .fileio import atomic_path

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

CONFIG, WEIGHTS, TOKENIZER = "config.json", "model.safetensors", "tokenizer.json"
STAGED = "pretrained"
"""Subdirectory of RUN_DIR/prepared/ holding the copied config.json + model.safetensors."""
PAD_ID = 0
"""The pipeline pads token ids with 0 (data.PAD_ID) and keeps that embedding row out of training."""


# ----------------------------------------------------------------------------- reading DIR

def read_config(directory: Path, files: tuple[str, ...] = (CONFIG, WEIGHTS, TOKENIZER)) -> dict[str, Any]:
    """DIR/config.json after checking that `files` exist (BadConfigError naming the missing)."""
    directory = Path(directory)
    missing = [name for name in files if not (directory / name).is_file()]
    if missing:
        raise BadConfigError(
            f"--pretrained {directory} lacks {', '.join(missing)}; pass a directory saved with "
            "transformers' save_pretrained(safe_serialization=True) plus the tokenizer's tokenizer.json")
    try:
        return json.loads((directory / CONFIG).read_text("utf-8"))
    except ValueError as exc:
        raise BadConfigError(f"{directory / CONFIG} is not valid JSON: {exc}") from None


def architecture_problems(config: dict[str, Any]) -> list[str]:
    """Why a config.json does not describe a BERT encoder this project's TextEncoder can reproduce."""
    problems = []
    if config.get("model_type") != "bert":
        problems.append(f"model_type is {config.get('model_type')!r}; only BERT encoders (model_type 'bert') "
                        "map onto the project's encoder")
    if config.get("hidden_act", "gelu") != "gelu":
        problems.append(f"hidden_act is {config.get('hidden_act')!r}; the encoder's FFN uses exact GELU ('gelu')")
    if config.get("position_embedding_type", "absolute") != "absolute":
        problems.append(f"position_embedding_type is {config.get('position_embedding_type')!r}; "
                        "the encoder has absolute learned positions only")
    if config.get("is_decoder") or config.get("add_cross_attention"):
        problems.append("is_decoder/add_cross_attention is set; only a bidirectional encoder fits")
    if config.get("pad_token_id", PAD_ID) != PAD_ID:
        problems.append(f"pad_token_id is {config.get('pad_token_id')}; the pipeline pads with token id {PAD_ID}")
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                "max_position_embeddings"):
        if not isinstance(config.get(key), int) or config[key] < 1:
            problems.append(f"{key} is {config.get(key)!r}; expected a positive integer")
    if not problems and config["hidden_size"] % config["num_attention_heads"]:
        problems.append(f"hidden_size {config['hidden_size']} is not divisible by num_attention_heads "
                        f"{config['num_attention_heads']}")
    return problems


def _bert_layer_shapes(config: dict[str, Any], i: int) -> dict[str, tuple[tuple[int, ...], str]]:
    hidden, ffn = config["hidden_size"], config["intermediate_size"]
    h = (hidden,), "hidden_size"
    square = (hidden, hidden), "hidden_size x hidden_size"
    prefix = f"encoder.layer.{i}."
    shapes = {f"{prefix}attention.self.{p}.weight": square for p in ("query", "key", "value")}
    shapes.update({f"{prefix}attention.self.{p}.bias": h for p in ("query", "key", "value")})
    shapes.update({
        f"{prefix}attention.output.dense.weight": square, f"{prefix}attention.output.dense.bias": h,
        f"{prefix}attention.output.LayerNorm.weight": h, f"{prefix}attention.output.LayerNorm.bias": h,
        f"{prefix}intermediate.dense.weight": ((ffn, hidden), "intermediate_size x hidden_size"),
        f"{prefix}intermediate.dense.bias": ((ffn,), "intermediate_size"),
        f"{prefix}output.dense.weight": ((hidden, ffn), "hidden_size x intermediate_size"),
        f"{prefix}output.dense.bias": h, f"{prefix}output.LayerNorm.weight": h, f"{prefix}output.LayerNorm.bias": h,
    })
    return shapes


def expected_shapes(config: dict[str, Any]) -> dict[str, tuple[tuple[int, ...], str]]:
    """BertModel tensor name -> (shape config.json implies, which config fields set it)."""
    hidden = config["hidden_size"]
    shapes = {
        "embeddings.word_embeddings.weight": ((config["vocab_size"], hidden), "vocab_size x hidden_size"),
        "embeddings.position_embeddings.weight": ((config["max_position_embeddings"], hidden),
                                                  "max_position_embeddings x hidden_size"),
        "embeddings.token_type_embeddings.weight": ((config.get("type_vocab_size", 2), hidden),
                                                    "type_vocab_size x hidden_size"),
        "embeddings.LayerNorm.weight": ((hidden,), "hidden_size"),
        "embeddings.LayerNorm.bias": ((hidden,), "hidden_size"),
    }
    for i in range(config["num_hidden_layers"]):
        shapes.update(_bert_layer_shapes(config, i))
    return shapes


def _canonical(name: str) -> str:
    """A BertModel name from a BertModel / BertFor* / TF-converted checkpoint's name."""
    name = name.removeprefix("bert.")
    return name.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias")


def weight_shapes(weights: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape from the safetensors header (no tensor data is read)."""
    from safetensors import safe_open

    try:
        with safe_open(str(weights), framework="pt") as fh:
            return {_canonical(k): tuple(fh.get_slice(k).get_shape()) for k in fh.keys()}
    except Exception as exc:  # safetensors raises its own SafetensorError for a damaged file
        raise BadConfigError(f"{weights} is not a readable safetensors file: {exc}") from None


def weight_problems(config: dict[str, Any], shapes: dict[str, tuple[int, ...]]) -> list[str]:
    """Tensors missing from model.safetensors or shaped differently from what config.json says."""
    problems, missing_layers = [], set()
    expected = expected_shapes(config)
    for name, (shape, fields) in expected.items():
        if name not in shapes:
            layer = name.split(".")[2] if name.startswith("encoder.layer.") else None
            if layer is not None and not any(n.startswith(f"encoder.layer.{layer}.") for n in shapes):
                missing_layers.add(int(layer))  # a whole layer: one line, not sixteen
            else:
                problems.append(f"{WEIGHTS} has no {name} ({fields} {list(shape)} per {CONFIG})")
        elif shapes[name] != shape:
            problems.append(f"{name} is {list(shapes[name])} in {WEIGHTS} but {CONFIG} implies {list(shape)} "
                            f"({fields})")
    if missing_layers:
        problems.append(f"{WEIGHTS} has no encoder.layer tensors for layer(s) {sorted(missing_layers)} but "
                        f"{CONFIG} says num_hidden_layers {config['num_hidden_layers']}")
    extra_layers = {n.split(".")[2] for n in shapes if n.startswith("encoder.layer.") and n not in expected}
    if extra_layers:
        problems.append(f"{WEIGHTS} has {len(extra_layers)} layer(s) beyond {CONFIG}'s num_hidden_layers "
                        f"{config['num_hidden_layers']}")
    if len(problems) > 8:
        problems = problems[:8] + [f"and {len(problems) - 8} more"]
    return problems


def check(directory: Path, *, max_length: int | None = None, tokenizer_vocab: int | None = None,
          files: tuple[str, ...] = (CONFIG, WEIGHTS, TOKENIZER)) -> dict[str, Any]:
    """DIR's config.json when DIR holds a BERT this project can start from; BadConfigError (exit 78)
    listing every misfit otherwise. `max_length`: the longest sequence the run uses (data config)."""
    config = read_config(directory, files)
    problems = architecture_problems(config)
    if not problems:
        problems += weight_problems(config, weight_shapes(Path(directory) / WEIGHTS))
        if max_length is not None and max_length > config["max_position_embeddings"]:
            problems.append(f"the run's longest sequence is {max_length} tokens but max_position_embeddings is "
                            f"{config['max_position_embeddings']}; use a preset with shorter length buckets")
        if tokenizer_vocab is not None and tokenizer_vocab > config["vocab_size"]:
            problems.append(f"{TOKENIZER} has {tokenizer_vocab} tokens but vocab_size is {config['vocab_size']}")
    if problems:
        raise BadConfigError(f"--pretrained {directory} does not fit the project's encoder: " + "; ".join(problems))
    return config


# ----------------------------------------------------------------------------- prepare

def _copy_staged(source: Path, target: Path) -> None:
    for name in (CONFIG, WEIGHTS):
        with atomic_path(target / name) as tmp:
            shutil.copyfile(source / name, tmp)


def previous_staged(init_from: Path | None) -> Path | None:
    """The staged BERT of the run an --init-from source belongs to (a run dir, its checkpoints/ dir,
    or RUN_DIR/checkpoints/step-N.pt), if that run started from one."""
    if init_from is None:
        return None
    source = Path(init_from).resolve()
    for run_dir in (source, source.parent, source.parent.parent):
        found = staged_dir(run_dir / PREPARED_DIR)
        if found is not None:
            return found
    return None


def stage(directory: Path | None, prepared: Path, max_length: int, init_from: Path | None = None):
    """prepare's hook: with `directory`, check it, copy its config + weights to PREPARED/pretrained/
    and return (tokenizer, tokenizer.json bytes, origin). Without, return None after making
    PREPARED/pretrained/ what train needs: a copy of the --init-from run's (a model that started
    from BERT keeps BERT's encoder shape in incremental runs), else nothing (a copy left by an
    earlier prepare of this run dir is removed, so train does not start from it)."""
    from tokenizers import Tokenizer

    target = Path(prepared) / STAGED
    if directory is None:
        previous = previous_staged(init_from)
        if previous is not None and previous.resolve() != target.resolve():
            _copy_staged(previous, target)
            log.info("the --init-from run started from a pretrained BERT: its encoder shape carried over from %s",
                     previous)
        elif previous is None and target.exists():
            log.info("removing %s left by an earlier prepare --pretrained", target)
            shutil.rmtree(target)
        return None
    directory = Path(directory)
    tokenizer_bytes = (directory / TOKENIZER).read_bytes() if (directory / TOKENIZER).is_file() else None
    try:
        tokenizer = Tokenizer.from_str(tokenizer_bytes.decode("utf-8")) if tokenizer_bytes else None
    except Exception as exc:  # tokenizers raises a bare Exception for a malformed file
        raise BadConfigError(f"{directory / TOKENIZER} is not a tokenizers tokenizer.json: {exc}") from None
    check(directory, max_length=max_length, tokenizer_vocab=tokenizer.get_vocab_size() if tokenizer else None)
    _copy_staged(directory, target)
    log.info("starting from the pretrained encoder in %s (tokenizer kept, weights copied to %s)", directory, target)
    return tokenizer, tokenizer_bytes, f"pretrained:{directory.resolve()}"


# ----------------------------------------------------------------------------- train

def staged_dir(prepared: Path) -> Path | None:
    """PREPARED/pretrained/ when prepare was run with --pretrained, else None."""
    target = Path(prepared) / STAGED
    return target if (target / CONFIG).is_file() else None


def encoder_config(prepared: Path, base: ModelConfig) -> ModelConfig:
    """`base` (preset + data) with the encoder's shape taken from the staged BERT, if any, and
    linear heads that start as the identity (so the embedding size is the encoder's width): before
    its first step the model embeds exactly as the encoder with mean pooling does. The preset still
    decides dropout and the data shapes."""
    source = staged_dir(prepared)
    if source is None:
        return base
    config = json.loads((source / CONFIG).read_text("utf-8"))
    if base.vocab_size > config["vocab_size"]:
        raise BadConfigError(f"the prepared tokenizer has {base.vocab_size} tokens but the pretrained encoder in "
                             f"{source} embeds {config['vocab_size']}; rerun prepare with the same --pretrained")
    if base.max_positions > config["max_position_embeddings"]:
        raise BadConfigError(f"the prepared data needs {base.max_positions} positions but the pretrained encoder "
                             f"has {config['max_position_embeddings']}; use a preset with shorter length buckets")
    return dataclasses.replace(
        base, vocab_size=config["vocab_size"], hidden_size=config["hidden_size"],
        num_layers=config["num_hidden_layers"], num_heads=config["num_attention_heads"],
        intermediate_size=config["intermediate_size"], layer_norm_eps=float(config.get("layer_norm_eps", 1e-12)),
        norm_position="post", head="linear", embedding_dim=config["hidden_size"])


def encoder_state(weights: dict[str, torch.Tensor], num_layers: int, max_positions: int) -> dict[str, torch.Tensor]:
    """TextEncoder state_dict (pipeline_steps/model.py) from transformers' BertModel tensors.
    BERT's pooler.* is not mapped: the towers mean-pool the token states."""
    import torch

    w = {_canonical(k): v.float() for k, v in weights.items()}
    state = {
        "token.weight": w["embeddings.word_embeddings.weight"],
        # One text per input, so always segment 0: its token-type vector folds into every position's.
        "position.weight": (w["embeddings.position_embeddings.weight"][:max_positions]
                            + w["embeddings.token_type_embeddings.weight"][0]),
        "embed_norm.weight": w["embeddings.LayerNorm.weight"],
        "embed_norm.bias": w["embeddings.LayerNorm.bias"],
    }
    for i in range(num_layers):
        src, dst = f"encoder.layer.{i}.", f"blocks.{i}."
        for kind in ("weight", "bias"):
            # The fused projection stacks query, key and value in that order (SelfAttention.forward).
            state[f"{dst}attn.qkv.{kind}"] = torch.cat(
                [w[f"{src}attention.self.{p}.{kind}"] for p in ("query", "key", "value")])
            state[f"{dst}attn.out.{kind}"] = w[f"{src}attention.output.dense.{kind}"]
            state[f"{dst}attn_norm.{kind}"] = w[f"{src}attention.output.LayerNorm.{kind}"]  # post-LN
            state[f"{dst}ffn.0.{kind}"] = w[f"{src}intermediate.dense.{kind}"]
            state[f"{dst}ffn.2.{kind}"] = w[f"{src}output.dense.{kind}"]
            state[f"{dst}ffn_norm.{kind}"] = w[f"{src}output.LayerNorm.{kind}"]  # post-LN
    return state


def init_encoder(prepared: Path, encoder: torch.nn.Module) -> bool:
    """train's hook: load the staged BERT weights into `encoder` (a TextEncoder built from
    `encoder_config`). Returns False (encoder untouched) when the run was prepared without one."""
    from safetensors.torch import load_file

    source = staged_dir(prepared)
    if source is None:
        return False
    config = check(source, files=(CONFIG, WEIGHTS))  # the tokenizer is the run's prepared one
    state = encoder_state(load_file(str(source / WEIGHTS)), config["num_hidden_layers"], encoder.max_positions)
    try:
        encoder.load_state_dict(state, strict=True)  # copies into the encoder's dtype and device
    except RuntimeError as exc:
        raise BadConfigError(f"the pretrained weights in {source} do not fit the encoder: {exc}") from None
    log.info("encoder initialised from the pretrained BERT in %s (%d layers, hidden %d)", source,
             config["num_hidden_layers"], config["hidden_size"])
    return True
