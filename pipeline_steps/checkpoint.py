"""Portable, verifiable, resumable checkpoints: DIR/checkpoints/step-NNNNNNNNN.pt + its .json manifest.

`save()` (global rank 0 only) writes the state atomically, then its manifest (sha256, bytes, step);
`latest()` / `resolve()` pick the newest checkpoint that verifies; `load()` reads it with
`torch.load(weights_only=True)` onto CPU; `load_model()` rebuilds the model from the stored config.
Format and guarantees: docs/training.md, "Checkpoints".
"""

from __future__ import annotations

import collections
import datetime as dt
import logging
import os
import pickle
import random
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pipeline_contract import CHECKPOINTS_DIR

from . import fileio
from .config import ModelConfig, from_dict
from .errors import BadInputError
from .model import EmbeddingModel

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
"""Bump when the state layout changes incompatibly; `load()` rejects other versions. The state:
{"format_version", "step", "epoch", "batch_in_epoch", "model", "optimizer", "scheduler",
"rng": rng_state(), "config": {"preset", "model", "data", "train"}, "tokenizer": {"sha256", "json"},
"schema": dict, "extra": dict}."""

_NAME = re.compile(r"^step-(\d{9,})\.(pt|json)$")
_TEMP_GLOB = ".step-*.tmp"  # fileio.atomic_path's temporary names for our files

# Files this process wrote or hashed, keyed by path -> (size, mtime_ns, sha256). Pruning runs at
# every save and would otherwise re-hash `keep` multi-GB files each time (slow on FSx); latest()
# and load() never use this cache, they always hash.
_verified: dict[str, tuple[int, int, str]] = {}


def checkpoint_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / CHECKPOINTS_DIR


def checkpoint_path(run_dir: str | os.PathLike, step: int) -> Path:
    return checkpoint_dir(run_dir) / f"step-{step:09d}.pt"


def manifest_path(checkpoint: str | os.PathLike) -> Path:
    return Path(checkpoint).with_suffix(".json")


def step_of(checkpoint: str | os.PathLike) -> int:
    """The optimizer step in a checkpoint's file name (step-000000120.pt -> 120)."""
    match = _NAME.match(Path(checkpoint).name)
    if match is None:
        raise ValueError(f"{checkpoint} is not named like a checkpoint (step-NNNNNNNNN.pt)")
    return int(match.group(1))


# ----------------------------------------------------------------------------- RNG state

def rng_state() -> dict[str, Any]:
    """Python `random`, numpy's global generator, torch CPU (and CUDA when available) RNG states,
    in a form `torch.load(weights_only=True)` accepts (no numpy arrays, no tuples of odd types)."""
    py_version, py_internal, py_gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_cached = np.random.get_state(legacy=True)
    return {
        "python": {"version": py_version, "state": torch.tensor(py_internal, dtype=torch.int64),
                   "gauss_next": py_gauss},
        # MT19937 keys are uint32; int64 holds them exactly and is a plain tensor type everywhere.
        "numpy": {"bit_generator": str(np_name), "keys": torch.from_numpy(np.asarray(np_keys).astype(np.int64)),
                  "pos": int(np_pos), "has_gauss": int(np_has_gauss), "cached_gaussian": float(np_cached)},
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what `rng_state()` captured. CUDA states are restored when this host has the same
    number of GPUs; otherwise (e.g. resuming a GPU run on CPU) they are skipped with a warning."""
    py = state["python"]
    random.setstate((int(py["version"]), tuple(int(v) for v in py["state"].tolist()), py["gauss_next"]))
    npy = state["numpy"]
    np.random.set_state((npy["bit_generator"], npy["keys"].numpy().astype(np.uint32), int(npy["pos"]),
                         int(npy["has_gauss"]), float(npy["cached_gaussian"])))
    torch.set_rng_state(state["torch"].to(torch.uint8))
    cuda = state.get("cuda")
    if cuda is not None:
        if torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)
        else:
            log.warning("checkpoint has CUDA RNG states for %d device(s); this host has %d: not restored",
                        len(cuda), torch.cuda.device_count() if torch.cuda.is_available() else 0)


# ----------------------------------------------------------------------------- verification

_SCALARS = (int, float, str, bool, type(None))
_MAPPINGS = (dict, collections.OrderedDict)  # state_dict() returns OrderedDict
_SEQUENCES = (list, tuple)


def _check_portable(obj: Any, where: str) -> None:
    """Raise TypeError/ValueError naming the first value that weights_only loading cannot read or
    that would tie the file to a device. Exact type checks on purpose: numpy scalars subclass
    float, and IntEnum / namedtuple subclass int / tuple, yet none of them is weights_only-safe."""
    if isinstance(obj, torch.Tensor):
        if obj.device.type != "cpu":
            raise ValueError(f"{where} is a tensor on {obj.device}; move the state to CPU first "
                             "(distributed.to_cpu) so the checkpoint loads on every backend")
        return
    kind = type(obj)
    if kind in _MAPPINGS:
        for key, value in obj.items():
            if type(key) not in _SCALARS:
                raise TypeError(f"{where} has a key of type {type(key).__name__}; use str or int keys")
            _check_portable(value, f"{where}[{key!r}]")
    elif kind in _SEQUENCES:
        for i, value in enumerate(obj):
            _check_portable(value, f"{where}[{i}]")
    elif kind not in _SCALARS:
        raise TypeError(
            f"{where} is a {kind.__module__}.{kind.__qualname__}, which torch.load(weights_only=True) "
            "cannot read; store tensors, dicts, lists, tuples, int, float, str, bool or None "
            "(e.g. a numpy array as torch.from_numpy(a), a numpy scalar as float(x))"
        )


def _problem(checkpoint: Path, *, use_cache: bool = False) -> str | None:
    """Why `checkpoint` cannot be used, or None when its manifest, size and sha256 agree."""
    manifest = manifest_path(checkpoint)
    if not checkpoint.exists():
        return "manifest without its checkpoint file"
    if not manifest.exists():
        return "no manifest (the save was interrupted before it completed)"
    try:
        meta = fileio.read_json(manifest)
        expected_bytes, expected_sha = int(meta["bytes"]), str(meta["sha256"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"unreadable manifest {manifest.name}: {exc!r}"
    stat = checkpoint.stat()
    if stat.st_size != expected_bytes:
        return f"size is {stat.st_size} bytes but the manifest says {expected_bytes} (truncated?)"
    cached = _verified.get(str(checkpoint)) if use_cache else None
    if cached is not None and cached[:2] == (stat.st_size, stat.st_mtime_ns):
        actual_sha = cached[2]
    else:
        actual_sha = fileio.sha256_file(checkpoint)
        _verified[str(checkpoint)] = (stat.st_size, stat.st_mtime_ns, actual_sha)
    if actual_sha != expected_sha:
        return f"sha256 {actual_sha[:16]}... does not match the manifest's {expected_sha[:16]}... (corrupted)"
    return None


def _candidates(directory: Path) -> list[Path]:
    """Every step that has a .pt or a manifest, as .pt paths, newest step first."""
    if not directory.is_dir():
        return []
    steps = {int(m.group(1)) for m in map(_NAME.match, os.listdir(directory)) if m}
    return [directory / f"step-{step:09d}.pt" for step in sorted(steps, reverse=True)]


def _latest_in(directory: Path) -> Path | None:
    for checkpoint in _candidates(directory):
        problem = _problem(checkpoint)
        if problem is None:
            return checkpoint
        log.warning("skipping checkpoint %s: %s; trying the previous one", checkpoint, problem)
    return None


# ----------------------------------------------------------------------------- public API

def save(run_dir: str | os.PathLike, state: dict[str, Any], *, keep: int) -> Path:
    """Write `state` as DIR/checkpoints/step-NNNNNNNNN.pt + manifest, atomically; then keep the
    newest `keep` valid checkpoints (always including this one) and delete the rest, stray
    temporary files and unusable leftovers. Only the global rank 0 may call this."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    for key in ("step", "epoch"):
        if type(state.get(key)) is not int or state[key] < 0:
            raise ValueError(f"state[{key!r}] must be an int >= 0, got {state.get(key)!r}")
    version = state.get("format_version", FORMAT_VERSION)
    if version != FORMAT_VERSION:
        raise ValueError(f"state['format_version'] is {version!r}; this code writes {FORMAT_VERSION}")
    state = {**state, "format_version": FORMAT_VERSION}
    # Refuse up front what torch.load(weights_only=True) could not read back, or a tensor tied to a
    # device: the file would only fail at load time.
    _check_portable(state, "state")

    path = checkpoint_path(run_dir, state["step"])
    # A manifest left from an earlier save of the same step (a rerun) would describe the old file
    # for a moment after the rename below; remove it first so there is never a wrong manifest.
    manifest_path(path).unlink(missing_ok=True)
    with fileio.atomic_path(path) as tmp:
        torch.save(state, tmp)
        num_bytes = tmp.stat().st_size
        sha256 = fileio.sha256_file(tmp)
    stat = path.stat()
    _verified[str(path)] = (stat.st_size, stat.st_mtime_ns, sha256)
    # The manifest goes second, so it only ever describes a complete .pt; a crash in between leaves
    # a .pt without manifest, which latest() never uses.
    fileio.atomic_write_json(manifest_path(path), {
        "format_version": FORMAT_VERSION,
        "step": state["step"],
        "epoch": state["epoch"],
        "batch_in_epoch": state.get("batch_in_epoch"),
        "sha256": sha256,
        "bytes": num_bytes,
        "created_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "file": path.name,
        "torch": torch.__version__,
    })
    log.info("saved checkpoint %s (%.1f MB)", path, num_bytes / 1e6)
    _prune(path.parent, keep=keep, current=path)
    return path


def _prune(directory: Path, *, keep: int, current: Path) -> None:
    # Single writer, and it is not writing now: any temporary file here is from a crashed save.
    for stray in directory.glob(_TEMP_GLOB):
        log.info("removing temporary file of an interrupted save: %s", stray)
        stray.unlink(missing_ok=True)
    kept = 1  # `current`, just written and hashed
    for checkpoint in _candidates(directory):
        if checkpoint == current:
            continue
        problem = _problem(checkpoint, use_cache=True)
        if problem is None and kept < keep:
            kept += 1
            continue
        if problem is not None:
            log.warning("removing unusable checkpoint %s: %s", checkpoint, problem)
        manifest_path(checkpoint).unlink(missing_ok=True)  # manifest first: never a dangling valid-looking pair
        checkpoint.unlink(missing_ok=True)
        _verified.pop(str(checkpoint), None)


def latest(run_dir: str | os.PathLike) -> Path | None:
    """The newest checkpoint of `run_dir` whose size and sha256 match its manifest, or None.
    Corrupt, truncated or manifest-less ones are skipped with a warning naming file and reason."""
    return _latest_in(checkpoint_dir(run_dir))


def resolve(run_dir_or_checkpoint: str | os.PathLike) -> Path:
    """A checkpoint file for --init-from / --checkpoint: a .pt file (or its manifest) as given, or
    the latest valid checkpoint of a run directory (or of a checkpoints directory). BadInputError
    when there is none."""
    given = Path(run_dir_or_checkpoint)
    if not given.exists():
        raise BadInputError(
            f"{given} does not exist; pass a run directory (holding checkpoints/) or a checkpoint "
            "file such as RUN_DIR/checkpoints/step-000000120.pt"
        )
    if given.is_file():
        # A manifest names its checkpoint: accept either file of the pair.
        return given.with_suffix(".pt") if _NAME.match(given.name) else given
    directory = checkpoint_dir(given) if checkpoint_dir(given).is_dir() else given
    found = _latest_in(directory)
    if found is not None:
        return found
    num_candidates = len(_candidates(directory))
    if num_candidates:
        raise BadInputError(
            f"none of the {num_candidates} checkpoint(s) in {directory} verifies against its manifest "
            "(see the warnings above); pass an intact step-*.pt explicitly or retrain"
        )
    raise BadInputError(
        f"no checkpoints in {directory}; produce one with "
        f"`python -m pipeline_steps train --run-dir {given} --preset tiny` (train writes one every "
        "checkpoint_every steps and at the end)"
    )


def load(path: str | os.PathLike) -> dict[str, Any]:
    """Read a checkpoint onto CPU, verifying it against its manifest first (when there is one)."""
    path = Path(path)
    if not path.is_file():
        raise BadInputError(f"checkpoint {path} not found; pass an existing step-*.pt or a run directory")
    if manifest_path(path).exists():
        problem = _problem(path)
        if problem is not None:
            raise BadInputError(
                f"checkpoint {path} failed verification: {problem}. Pass the run directory instead "
                "to fall back to the newest intact checkpoint, or an older step-*.pt"
            )
    else:
        log.warning("checkpoint %s has no manifest; loading it without checksum verification", path)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (RuntimeError, pickle.UnpicklingError, EOFError, ValueError) as exc:
        raise BadInputError(f"{path} is not a readable checkpoint: {exc}") from exc
    if not isinstance(state, dict) or "format_version" not in state:
        raise BadInputError(f"{path} is not a pipeline_steps checkpoint (no format_version)")
    if state["format_version"] != FORMAT_VERSION:
        raise BadInputError(
            f"checkpoint {path} has format_version {state['format_version']!r}, this version of "
            f"pipeline_steps reads format {FORMAT_VERSION}; use the pipeline_steps version that wrote it"
        )
    return state


def load_model(path: str | os.PathLike) -> tuple[EmbeddingModel, dict[str, Any]]:
    """Rebuild the model from the checkpoint's stored config and load its weights (strict).
    `path` is a .pt file or a run directory (its latest valid checkpoint). Returns (model in eval
    mode, float32, on CPU; the loaded state)."""
    path = resolve(path)
    state = load(path)
    try:
        cfg = from_dict(ModelConfig, dict(state["config"]["model"]))
    except (KeyError, TypeError) as exc:
        raise BadInputError(f"checkpoint {path} has no usable config.model ({exc!r})") from exc
    # Build on the meta device and materialise uninitialised storage: the strict load below
    # overwrites every tensor, so random init (seconds on the large preset) would be wasted.
    with torch.device("meta"):
        model = EmbeddingModel(cfg)
    model = model.to_empty(device="cpu")
    weights = dict(state["model"])
    torch.nn.modules.utils.consume_prefix_in_state_dict_if_present(weights, "module.")  # saved through DDP
    try:
        model.load_state_dict(weights, strict=True)  # copies and casts: a bf16 checkpoint loads as fp32
    except RuntimeError as exc:
        raise BadInputError(f"weights in {path} do not match its stored model config: {exc}") from exc
    return model.eval(), state
