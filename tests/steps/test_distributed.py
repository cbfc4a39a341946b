"""pipeline_steps.distributed: a lost peer is a retryable failure, anything else is not."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from pipeline_steps import distributed
from pipeline_steps.errors import ExitCode, RetryableError

from .conftest import REPO
from .fixtures_trained import tiny_trained  # noqa: F401  (a session fixture)

TWO_RANKS = distributed.World("cpu", 0, 2, 0, torch.device("cpu"))
ONE_RANK = distributed.World("cpu", 0, 1, 0, torch.device("cpu"))
# What the surviving rank's loss.backward() raised when the other node was killed (torch 2.9, gloo).
GLOO_PEER_RESET = RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:538] Read error "
                               "[127.0.0.1]:4527: Connection reset by peer")


def test_a_lost_peer_becomes_the_retryable_exit_code():
    with pytest.raises(RetryableError, match="a peer of rank 0 of 2 went away .*Connection reset by peer") as info:
        with distributed.transient_faults_are_retryable(TWO_RANKS, "training"):
            raise GLOO_PEER_RESET
    assert info.value.exit_code == ExitCode.RETRYABLE
    with pytest.raises(RetryableError):
        with distributed.transient_faults_are_retryable(TWO_RANKS, "training"):
            raise dist.DistBackendError("NCCL communicator was aborted")


@pytest.mark.parametrize("world, error", [
    (TWO_RANKS, RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 5x6)")),  # a bug stays a bug
    (ONE_RANK, GLOO_PEER_RESET),  # no peers to lose
])
def test_other_errors_pass_through_unchanged(world, error):
    with pytest.raises(RuntimeError) as info:
        with distributed.transient_faults_are_retryable(world, "training"):
            raise error
    assert info.value is error


# What the Neuron runtime and collectives report (formats of libnrt's `nrt_<call> status=<code>
# message=...` errors, its infodump's status names, and the collectives library's CCOM/NCCOM lines).
NEURON_FAULTS = [
    RuntimeError('INTERNAL: nrt_execute status=5 message="Timeout Exceeded"'),
    RuntimeError("ERROR NRT:nrt_infodump Failure: NRT_EXEC_HW_ERR_COLLECTIVES in nrt_execute()"),
    RuntimeError("Bad StatusOr access: INTERNAL: nrt_execute status=1206 message=\"Network proxy failure\""),
    RuntimeError("socket.h:579 CCOM WARN Timeout waiting for RX (waited 120 sec)"),
    RuntimeError("NCCOM ERROR net.cc:311 RX, connection closed by remote peer"),
]


@pytest.mark.parametrize("error", NEURON_FAULTS, ids=["exec-timeout", "collectives-hang", "efa-proxy",
                                                       "ccom-timeout", "nccom-peer-closed"])
@pytest.mark.parametrize("world", [TWO_RANKS, ONE_RANK], ids=["two-ranks", "one-rank"])
def test_a_neuron_runtime_or_collectives_fault_becomes_the_retryable_exit_code(world, error):
    with pytest.raises(RetryableError, match="Neuron runtime or collectives fault") as info:
        with distributed.transient_faults_are_retryable(world, "training"):
            raise error
    assert info.value.exit_code == ExitCode.RETRYABLE


@pytest.mark.parametrize("error", [
    RuntimeError('nrt_tensor_allocate status=4 message="Allocation Failure"'),  # NRT_RESOURCE: the model does not fit
    RuntimeError("ERROR NRT:nrt_infodump Failure: NRT_EXEC_COMPLETED_WITH_NUM_ERR in nrt_execute()"),  # NaN
    RuntimeError("INTERNAL: RunNeuronCCImpl: error condition error != 0: neuronx-cc compilation failed"),
], ids=["out-of-device-memory", "numerical-error", "compiler-error"])
def test_deterministic_neuron_failures_are_not_retried(error):
    with pytest.raises(RuntimeError) as info:
        with distributed.transient_faults_are_retryable(TWO_RANKS, "training"):
            raise error
    assert info.value is error


def test_a_process_group_that_cannot_be_joined_is_retryable(monkeypatch):
    def timed_out(*args, **kwargs):
        raise dist.DistStoreError("Timed out after 1801 seconds waiting for clients. 1/2 clients joined.")

    monkeypatch.setattr(dist, "init_process_group", timed_out)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(RetryableError, match="could not join the gloo process group"):
        distributed.init("cpu")


def test_validate_and_embed_on_neuron_use_the_versioned_compile_cache(tiny_trained, monkeypatch):
    """Every XLA step (the inference loader validate and embed share, and train) points the Neuron
    runtime at the stage's versioned persistent cache when it joins the device; before, only
    train and compile did, so validate and embed recompiled every graph on every run."""
    from pipeline_steps.inference import load_for_inference

    monkeypatch.setattr(distributed, "neuron_available", lambda: True)  # a Trainium host, as far as init sees
    monkeypatch.setenv("PJRT_DEVICE", "CPU")  # ... whose device is this machine's XLA CPU client
    monkeypatch.setenv("NEURON_COMPILE_CACHE_URL_BASE", "s3://cache-bucket/neuron")
    monkeypatch.delenv("NEURON_COMPILE_CACHE_URL", raising=False)
    load_for_inference(tiny_trained, "xla")
    assert os.environ["NEURON_COMPILE_CACHE_URL"] == distributed.neuron_cache_url("s3://cache-bucket/neuron")
    assert os.environ["NEURON_COMPILE_CACHE_URL"].startswith("s3://cache-bucket/neuron/neuronx-cc-")


def test_a_loaded_optimizer_state_keeps_fp32_moments_and_its_step_counts_with_bf16_weights():
    # torch's load_state_dict casts floating state to the parameter's dtype: bf16 moments here.
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(4, 3).bfloat16()), torch.nn.Parameter(torch.randn(3).bfloat16())]
    saved = {"state": {i: {"step": torch.tensor(7.0), "exp_avg": torch.randn(p.shape) * 1e-3,
                           "exp_avg_sq": torch.rand(p.shape) * 1e-7} for i, p in enumerate(params)},
             "param_groups": [{**torch.optim.AdamW(params, lr=0.5).param_groups[0], "params": [0, 1]}]}
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    distributed.init_optimizer_state(ONE_RANK, optimizer, saved)
    distributed.load_optimizer_state(optimizer, saved)
    assert optimizer.param_groups[0]["lr"] == 0.5
    for i, param in enumerate(params):
        state = optimizer.state[param]
        assert float(state["step"]) == 7.0
        for key in ("exp_avg", "exp_avg_sq"):
            assert state[key].dtype == torch.float32
            assert torch.equal(state[key], saved["state"][i][key])  # not rounded through bf16


def run_xla(script: str) -> dict:
    """`script` in its own process on PJRT CPU (torch_xla stays out of the test process), one
    rank: its last line of output, as JSON."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(PJRT_DEVICE="CPU", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-c", script], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


XLA_ADAMW_SCRIPT = """
import json
import torch
from pipeline_steps import distributed

world = distributed.init("xla")
torch.manual_seed(0)
# bf16 values, so the fp32 reference starts from exactly the same weights and gradients
weights = [(torch.randn(64, 32) * 0.02).bfloat16().float(), (torch.randn(32) * 0.02).bfloat16().float()]
grads = [(torch.randn(64, 32) * 1e-3).bfloat16().float(), (torch.randn(32) * 1e-3).bfloat16().float()]
kwargs = dict(lr=2e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01)

def run(dtype, device, found_inf=None):
    params = [torch.nn.Parameter(w.to(dtype).to(device, copy=True)) for w in weights]
    if device == "cpu":
        optimizer = torch.optim.AdamW(params, **kwargs)
    else:
        optimizer = distributed.make_adamw(world, [{"params": params}], **kwargs)
        distributed.init_optimizer_state(world, optimizer)
    for _ in range(3):
        for param, grad in zip(params, grads):
            param.grad = grad.to(dtype).to(device, copy=True)
        if device == "cpu":
            optimizer.step()
        else:
            distributed.optimizer_step(world, optimizer, found_inf)
        distributed.mark_step(world)
    states = [optimizer.state[p] for p in params]
    weights_now = [p.detach().cpu() for p in params]
    return weights_now, [s["exp_avg_sq"].cpu() for s in states], [float(s["step"]) for s in states]

bf16, bf16_sq, bf16_steps = run(torch.bfloat16, world.device)
fp32, fp32_sq, _ = run(torch.float32, "cpu")  # torch's AdamW in fp32 on the bf16 start point
skipped, _, skipped_steps = run(torch.bfloat16, world.device, torch.ones((), device=world.device))
start = [w.bfloat16() for w in weights]
print(json.dumps({
    "dtypes": sorted({str(t.dtype) for t in bf16 + bf16_sq}),
    "steps": bf16_steps, "skipped_steps": skipped_steps,
    "weights_err": max(float((a.float() - b).abs().max()) for a, b in zip(bf16, fp32)),
    "moved": min(float((a.float() - s.float()).abs().max()) for a, s in zip(bf16, start)),
    "sq_rel_err": max(float(((a - b).abs() / b.abs().clamp_min(1e-30)).max()) for a, b in zip(bf16_sq, fp32_sq)),
    "skipped_unchanged": all(torch.equal(a, s) for a, s in zip(skipped, start)),
}))
"""


def test_xla_adamw_updates_bf16_weights_through_fp32_moments_and_skips_in_graph():
    out = run_xla(XLA_ADAMW_SCRIPT)
    assert out["dtypes"] == ["torch.bfloat16", "torch.float32"]  # bf16 weights, fp32 second moments
    assert out["steps"] == [3.0, 3.0] and out["skipped_steps"] == [0.0, 0.0]
    # torch's fp32 AdamW from the same start: equal up to bf16 rounding of the weights (|w| < 0.1,
    # bf16 spacing there <= 2**-11); the fp32 second moments agree (in bf16, beta2 = 0.999 would
    # round to 1.0 and they would stay 0).
    assert out["moved"] > 1e-3
    assert out["weights_err"] < 2 ** -10
    assert out["sq_rel_err"] < 1e-4
    assert out["skipped_unchanged"]


XLA_DROPOUT_SCRIPT = """
import dataclasses, json
import torch
from pipeline_steps import distributed

world = distributed.init("xla")
ones = torch.ones(4096, device=world.device)
distributed.mark_step(world)
before = distributed.compile_count(world)
masks = {}
for rank, step in [(0, 5), (1, 5), (0, 6), (0, 5)]:
    distributed.seed_step(dataclasses.replace(world, rank=rank, world_size=2), seed=42, step=step)
    dropped = torch.nn.functional.dropout(ones, p=0.5, training=True) == 0
    distributed.mark_step(world)
    masks.setdefault(f"{rank},{step}", []).append(dropped.cpu())
(a, again), (b,), (c,) = masks["0,5"], masks["1,5"], masks["0,6"]
print(json.dumps({"same_rank_step": torch.equal(a, again), "rank_differs": float((a != b).float().mean()),
                  "step_differs": float((a != c).float().mean()), "graphs": distributed.compile_count(world) - before}))
"""


def test_each_rank_and_step_draws_its_own_xla_dropout_mask_and_a_rerun_draws_the_same():
    """The seeding the trainer calls before every step, on the XLA device in one process: the ranks
    are World values (PJRT CPU runs one process), so this shows what each rank's process would
    draw, not several processes at once."""
    out = run_xla(XLA_DROPOUT_SCRIPT)
    assert out["same_rank_step"]  # a resumed run redraws the uninterrupted run's mask
    assert 0.4 < out["rank_differs"] < 0.6 and 0.4 < out["step_differs"] < 0.6  # independent masks
    assert out["graphs"] == 1  # the seed is an input of the graph, not a constant in it
