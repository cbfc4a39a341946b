"""Checkpoints (pipeline_steps.checkpoint): atomic, verified, pruned, portable between XLA and eager."""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline_steps import checkpoint
from pipeline_steps.config import PRESETS, to_dict
from pipeline_steps.errors import BadInputError
from pipeline_steps.fileio import read_json, sha256_file
from pipeline_steps.model import EmbeddingModel, training_loss

REPO = Path(__file__).resolve().parents[2]
TINY = PRESETS["tiny"]
CFG = dataclasses.replace(TINY.model, num_numeric=2, categorical_cardinalities=(6,), num_classes=3)


pytestmark = pytest.mark.usefixtures("one_thread")


def make_inputs(rows: int = 8, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q_mask = torch.zeros(rows, 16, dtype=torch.int64)
    q_mask[:, :5] = 1
    d_mask = torch.zeros(rows, 32, dtype=torch.int64)
    d_mask[:, :20] = 1
    return {
        "query_ids": torch.randint(5, CFG.vocab_size, (rows, 16), generator=gen) * q_mask, "query_mask": q_mask,
        "doc_ids": torch.randint(5, CFG.vocab_size, (rows, 32), generator=gen) * d_mask, "doc_mask": d_mask,
        "numeric": torch.randn(rows, 2, generator=gen),
        "categorical": torch.randint(0, 6, (rows, 1), generator=gen),
        "row_mask": torch.ones(rows), "weight": torch.ones(rows),
        "class_id": torch.randint(0, 3, (rows,), generator=gen),
        "product_index": torch.arange(rows),
    }


def embed(model: EmbeddingModel, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        q = model.encode_queries(inputs["query_ids"], inputs["query_mask"])
        p = model.encode_products(inputs["doc_ids"], inputs["doc_mask"], inputs["numeric"], inputs["categorical"])
    return torch.cat([q, p])


def trained_objects():
    """Model, optimizer and scheduler after one real step, so optimizer state is populated."""
    torch.manual_seed(0)
    model = EmbeddingModel(CFG)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 10))
    loss, _ = training_loss(model, make_inputs(), TINY.train)
    loss.backward()
    optimizer.step()
    scheduler.step()
    return model, optimizer, scheduler


def make_state(model, optimizer=None, scheduler=None, *, step: int = 10) -> dict:
    return {
        "step": step, "epoch": 0, "batch_in_epoch": step,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict() if optimizer else {},
        "scheduler": scheduler.state_dict() if scheduler else {},
        "rng": checkpoint.rng_state(),
        "config": {"preset": "tiny", "model": to_dict(model.cfg), "data": to_dict(TINY.data),
                   "train": to_dict(TINY.train)},
        "tokenizer": {"sha256": "0" * 64, "json": "{}"},
        "schema": {"numeric_names": ["a", "b"]},
        "extra": {"note": "test"},
    }


def save_steps(run_dir: Path, steps, keep: int = 10) -> list[Path]:
    torch.manual_seed(0)
    model = EmbeddingModel(CFG)
    return [checkpoint.save(run_dir, make_state(model, step=s), keep=keep) for s in steps]


def draw_random_streams() -> tuple:
    """A few draws from every generator rng_state() captures."""
    return (random.random(), random.gauss(0, 1), np.random.rand(3).tolist(), np.random.randn(), torch.rand(3).tolist())


# ----------------------------------------------------------------------------- round trip

def test_round_trip_restores_weights_optimizer_scheduler_and_rng(tmp_path):
    model, optimizer, scheduler = trained_objects()
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    random.gauss(0, 1)  # leave a cached Gaussian in python's and numpy's generators
    np.random.randn()
    state = make_state(model, optimizer, scheduler, step=20)
    expected_streams = draw_random_streams()
    path = checkpoint.save(tmp_path, state, keep=3)
    assert path == tmp_path / "checkpoints" / "step-000000020.pt"
    assert checkpoint.step_of(path) == 20

    draw_random_streams()  # move every generator on
    loaded = checkpoint.load(path)
    checkpoint.set_rng_state(loaded["rng"])
    assert draw_random_streams() == expected_streams

    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded["model"][name], tensor), name
    restored_opt = torch.optim.AdamW(EmbeddingModel(CFG).parameters(), lr=1e-3)
    restored_opt.load_state_dict(loaded["optimizer"])
    restored_scheduler = torch.optim.lr_scheduler.LambdaLR(restored_opt, lambda step: 1.0)
    restored_scheduler.load_state_dict(loaded["scheduler"])
    assert restored_scheduler.last_epoch == scheduler.last_epoch == 1
    for a, b in zip(optimizer.state.values(), restored_opt.state.values()):
        assert torch.equal(a["exp_avg"], b["exp_avg"]) and torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])
    assert loaded["config"]["preset"] == "tiny" and loaded["extra"] == {"note": "test"}

    rebuilt, state_again = checkpoint.load_model(tmp_path)  # a run dir resolves to its latest
    assert checkpoint.resolve(path.with_suffix(".json")) == path == checkpoint.resolve(tmp_path / "checkpoints")
    assert not rebuilt.training and rebuilt.cfg == CFG and state_again["step"] == 20
    model.eval()
    assert torch.equal(embed(rebuilt, make_inputs(seed=4)), embed(model, make_inputs(seed=4)))


def test_manifest_describes_the_checkpoint(tmp_path):
    (path,) = save_steps(tmp_path, [7])
    manifest = read_json(path.with_suffix(".json"))
    assert manifest["step"] == 7 and manifest["epoch"] == 0 and manifest["format_version"] == 1
    assert manifest["file"] == path.name and manifest["bytes"] == path.stat().st_size
    assert manifest["sha256"] == sha256_file(path)
    assert manifest["created_at"].endswith("+00:00")


def test_save_refuses_state_that_weights_only_loading_cannot_read(tmp_path):
    torch.manual_seed(0)
    state = make_state(EmbeddingModel(CFG))
    state["rng"]["numpy_array"] = np.zeros(3)
    with pytest.raises(TypeError, match=r"numpy_array.*weights_only"):
        checkpoint.save(tmp_path, state, keep=2)
    assert checkpoint.latest(tmp_path) is None and not list(tmp_path.rglob("*.pt"))


# ----------------------------------------------------------------------------- corruption and crashes

def test_latest_skips_a_truncated_checkpoint_with_a_warning(tmp_path, caplog):
    older, newest = save_steps(tmp_path, [10, 20])
    with open(newest, "r+b") as fh:
        fh.truncate(newest.stat().st_size // 2)
    with caplog.at_level(logging.WARNING, logger="pipeline_steps.checkpoint"):
        assert checkpoint.latest(tmp_path) == older
    assert newest.name in caplog.text and "truncated" in caplog.text
    model, state = checkpoint.load_model(tmp_path)
    assert state["step"] == 10


def test_latest_skips_a_bit_flipped_checkpoint_with_a_warning(tmp_path, caplog):
    older, newest = save_steps(tmp_path, [10, 20])
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0x01
    newest.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="pipeline_steps.checkpoint"):
        assert checkpoint.latest(tmp_path) == older
    assert newest.name in caplog.text and "sha256" in caplog.text


def test_latest_ignores_a_checkpoint_without_manifest(tmp_path, caplog):
    older, newest = save_steps(tmp_path, [10, 20])
    newest.with_suffix(".json").unlink()
    with caplog.at_level(logging.WARNING):
        assert checkpoint.latest(tmp_path) == older
    assert "no manifest" in caplog.text


def test_pruning_keeps_the_newest_and_removes_leftovers(tmp_path):
    directory = tmp_path / "checkpoints"
    save_steps(tmp_path, [10, 20])
    (directory / ".step-000000030.pt.abc123.tmp").write_bytes(b"half a checkpoint")  # crashed save
    (directory / "step-000000005.pt").write_bytes(b"orphan without manifest")
    save_steps(tmp_path, [30, 40, 50], keep=3)
    assert sorted(p.name for p in directory.iterdir()) == [
        f"step-0000000{s}.{ext}" for s in (30, 40, 50) for ext in ("json", "pt")
    ]


def test_a_crash_during_save_leaves_no_partial_file_and_the_previous_latest(tmp_path, monkeypatch):
    (previous,) = save_steps(tmp_path, [10])
    real_save = torch.save

    def crash_halfway(obj, f, *args, **kwargs):
        Path(f).write_bytes(b"PK\x03\x04 the first bytes of a zip")
        raise OSError("No space left on device")

    monkeypatch.setattr(torch, "save", crash_halfway)
    with pytest.raises(OSError, match="No space"):
        save_steps(tmp_path, [20])
    monkeypatch.setattr(torch, "save", real_save)

    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "step-000000010.json", "step-000000010.pt"]
    assert checkpoint.latest(tmp_path) == previous


def test_load_rejects_a_checksum_mismatch(tmp_path):
    (path,) = save_steps(tmp_path, [10])
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(BadInputError, match="failed verification.*sha256"):
        checkpoint.load(path)


def test_load_rejects_an_incompatible_format_version(tmp_path):
    path = tmp_path / "future.pt"
    torch.save({"format_version": 99, "step": 1}, path)
    with pytest.raises(BadInputError, match="format_version 99"):
        checkpoint.load(path)


def test_clear_errors_when_there_is_nothing_to_load(tmp_path):
    with pytest.raises(BadInputError, match="does not exist"):
        checkpoint.resolve(tmp_path / "nope")
    with pytest.raises(BadInputError, match="not found"):
        checkpoint.load(tmp_path / "nope.pt")
    (tmp_path / "empty-run").mkdir()
    with pytest.raises(BadInputError, match=r"no checkpoints in .*pipeline_steps train --run-dir"):
        checkpoint.resolve(tmp_path / "empty-run")
    (only,) = save_steps(tmp_path / "broken-run", [10])
    only.write_bytes(b"garbage")
    with pytest.raises(BadInputError, match="none of the 1 checkpoint"):
        checkpoint.load_model(tmp_path / "broken-run")
    assert checkpoint.latest(tmp_path / "never-ran") is None


# ----------------------------------------------------------------------------- XLA <-> eager portability

XLA_SCRIPT = textwrap.dedent("""
    import sys
    import torch
    from pipeline_steps import checkpoint, distributed
    from pipeline_steps.config import ModelConfig, from_dict
    from pipeline_steps.model import EmbeddingModel

    eager_run, xla_run, inputs_path, out_path = sys.argv[1:5]
    world = distributed.init("xla")
    assert world.device.type == "xla", world.device
    inputs = torch.load(inputs_path)
    on_device = {k: v.to(world.device) for k, v in inputs.items()}

    def embed(model):
        with torch.no_grad():
            q = model.encode_queries(on_device["query_ids"], on_device["query_mask"])
            p = model.encode_products(on_device["doc_ids"], on_device["doc_mask"],
                                      on_device["numeric"], on_device["categorical"])
            out = torch.cat([q, p])
        distributed.mark_step(world)
        return distributed.to_cpu(out)

    # eager -> XLA: load the eager checkpoint, embed on the XLA device.
    model, _ = checkpoint.load_model(eager_run)
    from_eager = embed(model.to(world.device))

    # XLA -> eager: a differently seeded model living on the XLA device, saved through to_cpu.
    # (The same forward graph as above, so no second compile: XLA training is the train tests' job.)
    _, state = checkpoint.load_model(eager_run)
    torch.manual_seed(7)
    model = EmbeddingModel(from_dict(ModelConfig, state["config"]["model"])).to(world.device)
    model.eval()
    state = dict(state, step=state["step"] + 1, model=distributed.to_cpu(model.state_dict()),
                 rng=checkpoint.rng_state())
    checkpoint.save(xla_run, state, keep=2)
    torch.save({"from_eager": from_eager, "from_xla": embed(model)}, out_path)
""")


@pytest.fixture(scope="module")
def xla_round_trip(tmp_path_factory):
    root = tmp_path_factory.mktemp("portability")
    torch.manual_seed(0)
    eager_model = EmbeddingModel(CFG).eval()
    checkpoint.save(root / "eager-run", make_state(eager_model, step=3), keep=2)
    inputs = make_inputs(seed=11)
    torch.save(inputs, root / "inputs.pt")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(PJRT_DEVICE="CPU", PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [sys.executable, "-c", XLA_SCRIPT, str(root / "eager-run"), str(root / "xla-run"),
         str(root / "inputs.pt"), str(root / "out.pt")],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {"eager_model": eager_model, "inputs": inputs, "root": root,
            "xla": torch.load(root / "out.pt", weights_only=True)}


def test_eager_checkpoint_gives_the_same_embeddings_under_xla(xla_round_trip):
    eager = embed(xla_round_trip["eager_model"], xla_round_trip["inputs"])
    torch.testing.assert_close(xla_round_trip["xla"]["from_eager"], eager, atol=1e-5, rtol=0)


def test_xla_checkpoint_gives_the_same_embeddings_on_eager_cpu(xla_round_trip):
    model, state = checkpoint.load_model(xla_round_trip["root"] / "xla-run")
    assert state["step"] == 4
    assert all(t.device.type == "cpu" for t in state["model"].values())
    before = embed(xla_round_trip["eager_model"], xla_round_trip["inputs"])
    after = embed(model, xla_round_trip["inputs"])
    assert (after - before).abs().max() > 1e-2  # really the XLA process's weights
    torch.testing.assert_close(after, xla_round_trip["xla"]["from_xla"], atol=1e-5, rtol=0)
