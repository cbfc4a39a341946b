"""The train step as users run it: DDP under torchrun, XLA on CPU, kill + resume, incremental training."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from pipeline_steps import checkpoint
from pipeline_steps.config import get_preset
from pipeline_steps.data import train_tokenizer
from pipeline_steps.errors import ExitCode
from pipeline_steps.fileio import read_json

from .conftest import REPO, cli_env, run_cli
from .fixtures_trained import tiny_trained, trained_run  # noqa: F401  fixtures

TRAIN = ("train", "--preset", "tiny", "--no-progress")


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "train" / "metrics.jsonl").read_text().splitlines()]


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return checkpoint.load(checkpoint.latest(run_dir))["model"]


def test_two_process_gloo_ddp_training_learns_and_checkpoints(tiny_run: Path) -> None:
    result = run_cli(*TRAIN, "--run-dir", tiny_run, "--backend", "cpu", torchrun=2)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = read_json(tiny_run / "train" / "summary.json")
    assert summary["world_size"] == 2
    assert summary["steps"] == summary["total_steps"] > 0
    rows = metrics(tiny_run)
    assert [r["step"] for r in rows] == list(range(1, summary["steps"] + 1))
    first, last = rows[0]["loss"], sum(r["loss"] for r in rows[-5:]) / 5
    assert last < 0.8 * first, f"loss did not go down: {first:.3f} -> {last:.3f}"
    assert checkpoint.step_of(checkpoint.latest(tiny_run)) == summary["steps"]


def test_xla_training_compiles_nothing_after_warmup(tiny_run_local) -> None:
    # The train step of `run-local --backend xla` (shared with test_run_local.py): the tiny preset's
    # two epochs cross an epoch boundary, padded last batches and checkpoint steps after warm-up;
    # none of them may trace a new graph.
    run_dir, result = tiny_run_local("xla")
    assert result.returncode == 0, result.stderr[-3000:]
    assert get_preset("tiny").train.epochs == 2
    xla = read_json(run_dir / "train" / "xla.json")
    assert xla["graphs_compiled"] > 0
    assert xla["compiles_after_warmup"] == 0, xla
    assert xla["warmup_steps"] <= 10
    summary = read_json(run_dir / "train" / "summary.json")
    assert summary["steps"] > 2 * xla["warmup_steps"]
    saved = [checkpoint.step_of(p) for p in (run_dir / "checkpoints").glob("step-*.pt")]
    assert any(xla["warmup_steps"] < step < summary["steps"] for step in saved), saved
    assert len({tuple(s["doc_ids"]) for s in xla["batch_shapes"]}) == len(xla["batch_shapes"])


def test_bf16_xla_training_trains_and_resumes_into_the_graphs_compile_traced(tiny_run: Path) -> None:
    """The production precision (`--bf16` on XLA): bf16 weights, fp32 AdamW moments
    (a bf16 update rounds beta2 = 0.999 to 1.0: the second moment would stay 0). A resumed run
    loads the moments without torch's cast to the weights' dtype, in a fresh run's order, so it
    needs no graph the compile step did not trace; the checkpoint also resumes on CPU."""
    args = ("--run-dir", tiny_run, "--backend", "xla", "--bf16")
    compiled = run_cli("compile", "--preset", "tiny", *args)
    assert compiled.returncode == 0, compiled.stderr[-3000:]
    first = run_cli(*TRAIN, *args, "--max-steps", "4", "--checkpoint-every", "2")
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = run_cli(*TRAIN, *args, "--max-steps", "6", "--checkpoint-every", "2")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stderr and "(step 4," in resumed.stderr
    assert read_json(tiny_run / "train" / "xla.json")["graphs_not_in_compile_cache"] == 0

    assert [r["step"] for r in metrics(tiny_run)] == list(range(1, 7))
    state = checkpoint.load(checkpoint.latest(tiny_run))
    assert {t.dtype for t in state["model"].values() if t.is_floating_point()} == {torch.bfloat16}
    moments = [entry[key] for entry in state["optimizer"]["state"].values() for key in ("exp_avg", "exp_avg_sq")]
    assert {m.dtype for m in moments} == {torch.float32}
    assert all(torch.isfinite(m).all() and m.abs().max() > 0 for m in moments)
    assert {float(entry["step"]) for entry in state["optimizer"]["state"].values()} == {6.0}
    # The same checkpoint resumes on an eager backend (weights cast up, moments as they are).
    eager = run_cli(*TRAIN, "--run-dir", tiny_run, "--backend", "cpu", "--max-steps", "7")
    assert eager.returncode == 0, eager.stderr[-3000:]
    assert "(step 6," in eager.stderr and checkpoint.step_of(checkpoint.latest(tiny_run)) == 7


RESUMED = ["--max-steps", "48", "--checkpoint-every", "4", "--backend", "cpu"]  # past the first epoch (42 steps)


@pytest.fixture(scope="module")
def reference_run(tiny_prepared: Path, tmp_path_factory) -> Path:
    """Read-only: a run dir trained without interruption with RESUMED's flags. The resumed run must
    end at its weights; the incremental tests start from it."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    shutil.copytree(tiny_prepared, run_dir)
    result = run_cli(*TRAIN, "--run-dir", run_dir, *RESUMED)
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir


def test_sigkilled_run_resumes_to_the_same_weights(tiny_run: Path, reference_run: Path) -> None:
    cmd = [sys.executable, "-m", "pipeline_steps", *TRAIN, "--run-dir", str(tiny_run), *RESUMED]
    proc = subprocess.Popen(cmd, env=cli_env(), cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            latest = checkpoint.latest(tiny_run)
            if latest is not None and checkpoint.step_of(latest) >= 8:
                os.kill(proc.pid, signal.SIGSTOP)  # freeze it mid-training, then kill it for real
                break
            time.sleep(0.01)
        killed_at = checkpoint.step_of(checkpoint.latest(tiny_run))
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert killed_at < 48, "the run finished before it could be killed; the test proved nothing"

    resumed = run_cli(*TRAIN, "--run-dir", tiny_run, *RESUMED)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stderr
    expected, actual = final_weights(reference_run), final_weights(tiny_run)
    assert expected.keys() == actual.keys()
    for name in expected:
        assert torch.equal(expected[name], actual[name]), f"{name} differs after resume"


def test_corrupt_latest_checkpoint_falls_back_to_the_previous_one(trained_run: Path) -> None:
    latest = checkpoint.latest(trained_run)  # tiny_trained: checkpoints at steps 2 and 4
    assert checkpoint.step_of(latest) == 4
    latest.write_bytes(latest.read_bytes()[: latest.stat().st_size // 2])  # a truncated write

    result = run_cli(*TRAIN, "--run-dir", trained_run, "--backend", "cpu", "--max-steps", "6",
                     "--checkpoint-every", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "step-000000004" in result.stderr and "WARNING" in result.stderr
    assert "resuming from" in result.stderr and "(step 2," in result.stderr
    assert checkpoint.step_of(checkpoint.latest(trained_run)) == 6


def test_incremental_training_keeps_the_tokenizer_and_starts_from_the_previous_model(
        reference_run: Path, tmp_path: Path) -> None:
    follow_up = tmp_path / "follow-up"
    prepared = run_cli("prepare", "--run-dir", follow_up, "--demo", "--preset", "tiny", "--seed", "7",
                       "--init-from", reference_run)
    assert prepared.returncode == 0, prepared.stderr[-3000:]
    assert (follow_up / "prepared" / "tokenizer.json").read_bytes() == \
        (reference_run / "prepared" / "tokenizer.json").read_bytes()

    result = run_cli(*TRAIN, "--run-dir", follow_up, "--backend", "cpu", "--max-steps", "3",
                     "--init-from", reference_run)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "incremental training" in result.stderr
    from_scratch_first_loss = metrics(reference_run)[0]["loss"]
    assert metrics(follow_up)[0]["loss"] < 0.8 * from_scratch_first_loss


def test_incremental_training_refuses_a_different_tokenizer(tiny_trained: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    shutil.copytree(tiny_trained / "prepared", other / "prepared")
    train_tokenizer(["a different corpus entirely"] * 50, 1024).save(str(other / "prepared" / "tokenizer.json"))

    result = run_cli(*TRAIN, "--run-dir", other, "--backend", "cpu", "--max-steps", "2", "--init-from", tiny_trained)
    assert result.returncode == ExitCode.BAD_CONFIG, result.stderr[-3000:]
    assert "--init-from" in result.stderr


@pytest.mark.parametrize("backend", ["cpu", "xla"])
def test_non_finite_loss_stops_before_the_update_with_its_exit_code(tiny_run: Path, backend: str) -> None:
    result = run_cli(*TRAIN, "--run-dir", tiny_run, "--backend", backend, "--lr", "1e12", "--max-steps", "30")
    assert result.returncode == ExitCode.NON_FINITE_LOSS, result.stderr[-3000:]
    assert re.search(r"loss is (nan|inf|-inf) at step \d+ .*stopped before the optimizer step", result.stderr)


# Runs in its own process: torch_xla stays out of the test process.
XLA_STEP_SCRIPT = """
import dataclasses, json, sys
from pathlib import Path
from pipeline_steps import distributed as dist_lib
from pipeline_steps.config import get_preset
from pipeline_steps.errors import NonFiniteLossError
from pipeline_steps.trainer import Trainer

world = dist_lib.init("xla")
trainer = Trainer(Path(sys.argv[1]), "tiny", get_preset("tiny").train, world)
host_batch = next(iter(trainer.batches.epoch(0)))
poisoned = {**host_batch, "weight": host_batch["weight"] * float("nan")}
batch, bad_batch = dist_lib.device_batches(world, [host_batch, poisoned])
trainer.train_step(batch)  # compiles
trainer.train_step(batch)
reads = dist_lib.host_transfers(world)
for _ in range(3):
    trainer.train_step(batch)
reads_in_steps = dist_lib.host_transfers(world) - reads

weights = lambda: dist_lib.to_cpu(dist_lib.unwrap(trainer.model).state_dict())
before = weights()
bad = trainer.train_step(bad_batch)
trainer.train_step(batch)  # dispatched before anyone read the bad step's loss
try:
    trainer.checked_values(bad)
    error = None
except NonFiniteLossError as exc:
    error = str(exc)
after = weights()

def first_step_loss(rank):  # a fresh trainer of one rank of two: the same weights, the same batch
    ranked = Trainer(Path(sys.argv[1]), "tiny", get_preset("tiny").train,
                     dataclasses.replace(world, rank=rank, world_size=2))
    return ranked.train_step(batch).host()["loss"]

print(json.dumps({"reads_in_steps": reads_in_steps, "error": error,
                  "unchanged": [k for k in before if before[k].equal(after[k])], "names": list(before),
                  "rank_losses": [first_step_loss(rank) for rank in (0, 1, 0)]}))
"""


def run_xla_step_script(run_dir: Path) -> dict:
    result = subprocess.run([sys.executable, "-c", XLA_STEP_SCRIPT, str(run_dir)], env=cli_env(), cwd=REPO,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def xla_steps(tiny_prepared: Path, tmp_path_factory) -> dict:
    run_dir = tmp_path_factory.mktemp("xla-steps") / "run"
    shutil.copytree(tiny_prepared, run_dir)
    return run_xla_step_script(run_dir)


def test_xla_train_step_reads_nothing_on_the_host(xla_steps: dict) -> None:
    # A host read inside the step would stall tracing of step N+1 until step N ran on the device.
    assert xla_steps["reads_in_steps"] == 0


def test_xla_non_finite_loss_is_never_applied_even_to_steps_dispatched_after_it(xla_steps: dict) -> None:
    assert xla_steps["error"] is not None and "at step 6 " in xla_steps["error"], xla_steps["error"]
    assert xla_steps["unchanged"] == xla_steps["names"]


def test_xla_ranks_draw_different_dropout_masks_and_a_rerun_draws_the_same(xla_steps: dict) -> None:
    # Only dropout differs between the ranks' first steps here; the second rank-0 trainer runs
    # after the others drew from the device generator, so it matches only if each step reseeds it.
    first, other_rank, again = xla_steps["rank_losses"]
    assert first == again
    assert first != other_rank


# Each rank's length buckets, step by step, from a fresh trainer and from one resumed mid-epoch.
BUCKETS_SCRIPT = """
import json, sys
from pathlib import Path
import torch.distributed as dist
from pipeline_steps import distributed as dist_lib
from pipeline_steps.config import get_preset
from pipeline_steps.trainer import Trainer, TrainState

run_dir, cfg = Path(sys.argv[1]), get_preset("tiny").train
world = dist_lib.init("cpu")

def widths(trainer):  # [global step, doc length] from the trainer's position to the end of training
    return [[trainer.state.step + n + 1, batch["doc_ids"].shape[1]]
            for n, (_, _, batch) in enumerate(trainer.epochs())]

whole = widths(Trainer(run_dir, "tiny", cfg, world))
stopped = Trainer(run_dir, "tiny", cfg, world)
stopped.state = TrainState(step=stopped.steps_per_epoch + 3, epoch=1, batch_in_epoch=3)
stopped.save_checkpoint()
ranks = [None] * world.world_size
dist.all_gather_object(ranks, {"whole": whole, "resumed": widths(Trainer(run_dir, "tiny", cfg, world)),
                               "resumed_at": stopped.state.step})
if world.is_main:
    print(json.dumps(ranks))
dist_lib.shutdown()
"""


def test_every_rank_takes_the_same_length_bucket_each_step_and_a_resumed_run_continues_the_sequence(
        tiny_run: Path, tmp_path: Path) -> None:
    """Ranks on different buckets in one step run different graphs and all wait for the longest.
    Two gloo processes under torchrun, through the trainer's batch order and a real checkpoint."""
    script = tmp_path / "buckets.py"
    script.write_text(BUCKETS_SCRIPT)
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                             str(script), str(tiny_run)], env=cli_env(), cwd=REPO, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    rank0, rank1 = json.loads(result.stdout.strip().splitlines()[-1])
    assert rank0["whole"] == rank1["whole"]
    assert len({width for _, width in rank0["whole"]}) > 1, "one bucket only: the test proves nothing"
    resumed_at = rank0["resumed_at"]
    assert rank0["resumed"] == rank1["resumed"] == rank0["whole"][resumed_at:]


def test_explicit_gradient_all_reduce_clips_the_averaged_gradients_like_ddp(tiny_run: Path, tmp_path: Path) -> None:
    # PIPELINE_GRAD_REDUCE=allreduce runs the XLA path's order on gloo: backward, all-reduce average,
    # clip, step. Clipping each worker's own gradients before averaging would end elsewhere than DDP.
    explicit = tmp_path / "explicit"
    shutil.copytree(tiny_run, explicit)
    steps = ("--backend", "cpu", "--max-steps", "6")
    ddp = run_cli(*TRAIN, "--run-dir", tiny_run, *steps, torchrun=2)
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    allreduce = run_cli(*TRAIN, "--run-dir", explicit, *steps, torchrun=2,
                        env=cli_env(PIPELINE_GRAD_REDUCE="allreduce"))
    assert allreduce.returncode == 0, allreduce.stderr[-3000:]
    expected, actual = final_weights(tiny_run), final_weights(explicit)
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=1e-4, atol=1e-5, msg=name)


def test_training_streams_its_curves_to_one_mlflow_child_run_every_log_every_steps(
        tiny_trained: Path, monkeypatch) -> None:
    """loss, lr and tokens/s reach the train child run every --log-every steps while training runs
    (the same run the step completes at the end), not only once training is over. tiny_trained
    trains 4 steps with --log-every 2 into the default store in its run dir."""
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # the default store in the run dir
    client = MlflowClient(tracking_uri=(tiny_trained / "mlruns").resolve().as_uri())
    runs = client.search_runs([client.get_experiment_by_name("trainium-embeddings").experiment_id])
    (train,) = [r for r in runs if r.info.run_name == "train" and r.data.tags.get("pipeline.run_id") == tiny_trained.name]
    assert train.info.status == "FINISHED"
    for key in ("loss", "lr", "tokens_per_s"):
        # (step 0: the end-of-training summary value of the same name, e.g. the mean tokens/s)
        steps = [m.step for m in client.get_metric_history(train.info.run_id, key) if m.step > 0]
        assert steps == [2, 4], key
