"""Device and world, resolved once: the only module that touches torch_xla / torch-neuronx.

Backends: `cpu` (eager, DDP over gloo under torchrun), `cuda` (eager, DDP over nccl) and `xla`
(PyTorch/XLA: Trainium with torch-neuronx and PJRT_DEVICE=NEURON; locally PJRT's CPU client in one
process). Multi-worker XLA averages gradients with an explicit `reduce_gradients` after backward,
without the DDP wrapper; `PIPELINE_GRAD_REDUCE=allreduce` runs eager training the same way, so the
XLA step order is testable with gloo (docs/training.md).

Everything else calls the functions here and never imports torch_xla, so the package imports and
the eager backends run where torch_xla is not installed.
"""

from __future__ import annotations

import importlib.util
import os
import random
import re
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch
import torch.distributed as dist

from pipeline_contract import COMPILE_CACHE_BASE_ENV

from .errors import BadConfigError, RetryableError
from .package_versions import versions  # re-exported: callers that already hold torch ask here

BACKENDS = ("cpu", "cuda", "xla")
GRAD_REDUCE_ENV = "PIPELINE_GRAD_REDUCE"
GRAD_REDUCE_MODES = ("ddp", "allreduce")


@dataclass(frozen=True)
class World:
    backend: str
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    grad_reduce: str = "ddp"
    """How gradients are averaged over workers: "ddp" (the DDP wrapper, during backward) or
    "allreduce" (an explicit all-reduce after backward; always on XLA)."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_xla(self) -> bool:
        return self.backend == "xla"

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def xla_available() -> bool:
    return importlib.util.find_spec("torch_xla") is not None


def neuron_available() -> bool:
    return importlib.util.find_spec("torch_neuronx") is not None


def default_backend() -> str:
    """`xla` on a Trainium host, `cuda` with a GPU, else `cpu`."""
    if neuron_available():
        return "xla"
    if torch.cuda.is_available():
        return "cuda"
    return "cpu"


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return default if value in (None, "") else int(value)


def init(backend: str) -> World:
    """Resolve the device and join the process group (torchrun's RANK/WORLD_SIZE/LOCAL_RANK)."""
    if backend not in BACKENDS:
        raise BadConfigError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    rank, world_size = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
    local_rank = _env_int("LOCAL_RANK", 0)

    if backend == "xla":
        if not xla_available():
            raise BadConfigError(
                "backend 'xla' needs torch_xla: `pip install torch-xla==2.9.0` (local) or run in the "
                "Neuron training image; or choose --backend cpu"
            )
        if neuron_available():
            # Every XLA step (train, and validate/embed on their own instances) reads and fills the
            # same versioned persistent cache, so no step recompiles a graph another one compiled.
            configure_neuron_cache()
        else:
            os.environ.setdefault("PJRT_DEVICE", "CPU")
        import torch_xla

        if world_size > 1:
            if not neuron_available():
                raise BadConfigError(
                    "multi-process XLA needs Trainium: torch-xla's CPU backend cannot run collectives "
                    "across processes (pytorch/xla#5005). Locally use --backend cpu under torchrun."
                )
            import torch_xla.distributed.xla_backend  # noqa: F401  registers the "xla" process group

            _join_process_group("xla", init_method="xla://")
        return World(backend, rank, world_size, local_rank, torch_xla.device(), grad_reduce="allreduce")

    if backend == "cuda":
        if not torch.cuda.is_available():
            raise BadConfigError("backend 'cuda' but no CUDA device is visible; choose --backend cpu")
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if world_size > 1 and not dist.is_initialized():
        _join_process_group("nccl" if backend == "cuda" else "gloo")
    return World(backend, rank, world_size, local_rank, device, grad_reduce=_eager_grad_reduce())


def _join_process_group(backend: str, **kwargs: Any) -> None:
    try:
        dist.init_process_group(backend, **kwargs)
    except (RuntimeError, ValueError) as exc:  # rendezvous timeouts, refused connections
        raise RetryableError(f"could not join the {backend} process group: {exc}") from exc


def _eager_grad_reduce() -> str:
    mode = os.environ.get(GRAD_REDUCE_ENV) or "ddp"
    if mode not in GRAD_REDUCE_MODES:
        raise BadConfigError(f"{GRAD_REDUCE_ENV}={mode!r} is not one of {', '.join(GRAD_REDUCE_MODES)}; "
                             "unset it to train with DDP")
    return mode


# A collective whose peer went away (its node was lost, its process killed) fails on the surviving
# ranks with a transport error: torch's DistError family (c10d, NCCL), or a plain RuntimeError
# naming gloo's TCP transport or the socket error.
_PEER_LOST_MARKERS = ("gloo/transport", "Connection reset by peer", "Connection closed by peer", "Broken pipe")

# A Neuron runtime or collectives fault is transient for the job (a retry may get other hosts):
# libnrt reports it as `nrt_<call> status=<code> message=...` or by status name (NRT_TIMEOUT,
# a collective stuck or a device or EFA proxy hardware error; nrt_status.h,
# https://awsdocs-neuron.readthedocs-hosted.com/en/latest/neuron-runtime/api/nrt_status.html), the
# collectives library (CCOM/NCCOM log lines) by a timeout or a peer closing the connection
# (https://awsdocs-neuron.readthedocs-hosted.com/en/latest/neuron-runtime/nrt-troubleshoot.html).
# Invalid NEFFs, allocation failures, out-of-bounds and NaN statuses are not transient, and a
# graph the compiler rejects is not a runtime fault (compile: exit 78).
_NRT_TRANSIENT = {"NRT_TIMEOUT": 5, "NRT_HW_ERROR": 6, "NRT_EXEC_UNIT_UNRECOVERABLE": 101, "NRT_COLL_PENDING": 1100,
                  "NRT_EXEC_HW_ERR_COLLECTIVES": 1200, "NRT_EXEC_HW_ERR_HBM_UE": 1201,
                  "NRT_EXEC_HW_ERR_NC_UE": 1202, "NRT_EXEC_HW_ERR_DMA_ABORT": 1203,
                  "NRT_EXEC_HW_ERR_REPAIRABLE_HBM_UE": 1205, "NRT_NETWORK_PROXY_FAILURE": 1206}
_NRT_STATUS = re.compile(r"\bnrt_\w+ status=(\d+)")
_NRT_NAME = re.compile(r"\bNRT_[A-Z_]+\b")
_COLLECTIVES_FAULT = re.compile(r"\bN?CCOM\b.*(timeout|timed out|connection closed)", re.IGNORECASE)  # on one line


def is_neuron_runtime_fault(exc: BaseException) -> bool:
    """A Neuron runtime or collectives timeout, hung collective or hardware error."""
    text = str(exc)
    codes = {int(code) for code in _NRT_STATUS.findall(text)}
    return bool(codes & set(_NRT_TRANSIENT.values()) or set(_NRT_NAME.findall(text)) & set(_NRT_TRANSIENT)
                or _COLLECTIVES_FAULT.search(text))


def is_peer_failure(exc: BaseException) -> bool:
    return isinstance(exc, dist.DistError) or (
        isinstance(exc, RuntimeError) and any(marker in str(exc) for marker in _PEER_LOST_MARKERS))


@contextmanager
def transient_faults_are_retryable(world: World, what: str) -> Iterator[None]:
    """Turn a lost peer or a Neuron runtime/collectives fault into RetryableError (exit 75: Batch
    retries the job, which resumes from the last checkpoint) instead of an internal error (exit 1:
    not retried)."""
    try:
        yield
    except RuntimeError as exc:
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        where = f"rank {world.rank} of {world.world_size}"
        if is_neuron_runtime_fault(exc):
            raise RetryableError(f"{what}: Neuron runtime or collectives fault on {where} ({detail})") from exc
        if world.distributed and is_peer_failure(exc):
            raise RetryableError(f"{what}: a peer of {where} went away ({detail})") from exc
        raise


def shutdown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def barrier(world: World) -> None:
    if not world.distributed:
        return
    if world.is_xla:
        import torch_xla.core.xla_model as xm

        xm.rendezvous("barrier")
    else:
        dist.barrier()


def seed_everything(seed: int) -> None:
    """The same seed on every rank: every rank builds the same initial weights (on XLA nothing
    broadcasts them)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def seed_step(world: World, seed: int, step: int) -> None:
    """Seed the generator dropout draws from with a hash of (seed, rank, step): ranks draw
    different masks, and a resumed run draws the ones an uninterrupted run would have.

    On XLA that is the device generator (`xm.set_rng_state`): its seed is a host-side value that
    every graph uploads as an input anyway, so reseeding reads nothing back and adds no graph."""
    value = int(np.random.SeedSequence([seed, world.rank, step]).generate_state(1, np.uint64)[0] >> 1)
    if world.is_xla:
        import torch_xla.core.xla_model as xm

        xm.set_rng_state(value, str(world.device))
    else:
        torch.manual_seed(value)


# ----------------------------------------------------------------------------- training-loop hooks

def mark_step(world: World) -> None:
    """Cut the lazy XLA graph here and run it; a no-op on eager backends."""
    if world.is_xla:
        import torch_xla

        torch_xla.sync()


def wait_device(world: World) -> None:
    """Block until every graph or kernel dispatched to the device has run (XLA runs a graph after
    `mark_step` returns; CUDA kernels run asynchronously); a no-op on CPU."""
    if world.is_xla:
        import torch_xla.core.xla_model as xm

        xm.wait_device_ops()
    elif world.backend == "cuda":
        torch.cuda.synchronize()


def prepare_model(world: World, model: torch.nn.Module, *, bf16: bool = False) -> torch.nn.Module:
    """Move to the device; wrap in DDP on multi-process eager backends (grad_reduce "ddp")."""
    model = model.to(world.device)
    if world.is_xla and bf16:
        model = model.to(torch.bfloat16)
    if world.distributed and not world.is_xla:
        if world.grad_reduce == "ddp":
            device_ids = [world.local_rank] if world.backend == "cuda" else None
            return torch.nn.parallel.DistributedDataParallel(model, device_ids=device_ids)
        # Without DDP nobody broadcasts rank 0's initial weights: do it, as DDP's constructor does.
        for tensor in [*model.parameters(), *model.buffers()]:
            dist.broadcast(tensor.data, src=0)
    return model


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


def make_adamw(world: World, groups: list[dict[str, Any]], **kwargs: Any) -> torch.optim.Optimizer:
    """AdamW for the backend: torch's on eager backends, `XlaAdamW` on XLA."""
    return (XlaAdamW if world.is_xla else torch.optim.AdamW)(groups, **kwargs)


class XlaAdamW(torch.optim.AdamW):
    """AdamW on XLA: torch_xla's sync-free update, one fused op per tensor, skipped in the graph
    when `found_inf` is nonzero (torch_xla amp/syncfree/adamw.py; torch's AdamW on XLA traces
    several in-place ops per tensor: measured 0.19 vs 0.10 s of host time per step on tiny).

    The moments and the update are fp32 whatever the weights' dtype. The fused op computes in its
    parameter's dtype, so bf16 weights are updated through an fp32 copy and rounded back once
    (stochastic rounding on Trainium): the Neuron BERT sample's default optimizer, which converts
    the gradients to fp32 and keeps fp32 state. A bf16 update would round beta2 = 0.999 to 1.0
    (the second moment never moves, its bias correction divides by zero). docs/training.md,
    "Precision"."""

    @torch.no_grad()
    def step(self, closure: Any = None, found_inf: torch.Tensor | None = None) -> None:  # type: ignore[override]
        # (found_inf: torch_xla's syncfree optimizers skip a non-finite step in-graph; torch's base has no such argument)
        from torch_xla.amp.syncfree import _functional as syncfree

        assert closure is None, "XlaAdamW.step takes no closure"
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            if found_inf is None:
                found_inf = torch.zeros((), dtype=torch.float32, device=params[0].device)
            states = [self.state[p] for p in params]
            fp32 = [p.float() for p in params]  # the parameter itself when it is fp32
            beta1, beta2 = group["betas"]
            syncfree.adam_step(
                found_inf, [s["step"] for s in states], fp32, [p.grad.float() for p in params],
                [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states],
                [s["max_exp_avg_sq"] for s in states], amsgrad=False, beta1=beta1, beta2=beta2,
                lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"], maximize=False,
                use_adamw=True)
            for param, updated in zip(params, fp32):
                if updated is not param:
                    param.copy_(updated)


def _saved_state(optimizer: torch.optim.Optimizer, saved: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Each parameter's entry of a saved optimizer `state_dict` (matched by position, as torch
    does), or empty entries without one."""
    if saved is None:
        return [{} for group in optimizer.param_groups for _ in group["params"]]
    return [saved["state"].get(i, {}) for group in saved["param_groups"] for i in group["params"]]


def init_optimizer_state(world: World, optimizer: torch.optim.Optimizer, saved: dict[str, Any] | None = None) -> None:
    """Create AdamW's state before the first step, as its lazy init would (torch optim/adam.py
    `_init_group`; torch_xla amp/syncfree/adamw.py), with fp32 moments (`XlaAdamW` updates bf16
    weights through fp32) and the step counts of `saved` (an optimizer state_dict), if given.

    Without this, step 1 traces an optimizer graph that creates the state and step 2 one that
    reads it: two graphs for the same work. On XLA the counts come from one uploaded vector,
    fresh or resumed: equal scalars uploaded one by one share a device buffer, and a graph with
    one input for all of them would be a graph the compile step never traced."""
    counts = [float(entry.get("step", 0)) for entry in _saved_state(optimizer, saved)]
    uploaded = torch.tensor(counts, dtype=torch.float32).to(world.device) if world.is_xla else None
    index = 0
    for group in optimizer.param_groups:
        on_device = group.get("capturable") or group.get("fused")
        for param in group["params"]:
            state = optimizer.state[param] = {}
            state["step"] = uploaded[index].clone() if uploaded is not None else torch.tensor(
                counts[index], dtype=torch.float32, device=param.device if on_device else "cpu")
            for key in ("exp_avg", "exp_avg_sq"):
                state[key] = torch.zeros_like(param, dtype=torch.float32, memory_format=torch.preserve_format)
            if world.is_xla:
                state["max_exp_avg_sq"] = torch.empty(0, dtype=torch.float32, device=param.device)
            index += 1


def load_optimizer_state(optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> None:
    """Copy the moments and hyperparameters of `saved` into the state `init_optimizer_state(...,
    saved)` made, in place, once that state exists on the device.

    torch's `load_state_dict` would replace the tensors: with new ones cast to the parameter's
    dtype (torch/optim/optimizer.py `_process_value_according_to_param_policy`: bf16 moments for
    bf16 weights), created in another order than a fresh run's. On XLA a graph's inputs and
    outputs follow tensor creation order, so the resumed run's step graphs would differ from the
    ones `compile` traced. Copying in place keeps dtype, device and order."""
    fresh = [optimizer.state[p] for group in optimizer.param_groups for p in group["params"]]
    optimizer.load_state_dict({"state": {}, "param_groups": saved["param_groups"]})  # checks the groups match
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for param, state, entry in zip(params, fresh, _saved_state(optimizer, saved)):
        for key in ("exp_avg", "exp_avg_sq"):
            if key in entry:
                state[key].copy_(entry[key])
        optimizer.state[param] = state


def reduce_gradients(world: World, optimizer: torch.optim.Optimizer) -> None:
    """Average the gradients over workers where backward did not already (DDP does it in backward).

    Call after backward and before clipping, so every worker clips the same averaged gradients,
    as DDP does. XLA: `xm.reduce_gradients` (what `xm.optimizer_step` calls right before the update:
    https://github.com/pytorch/xla/blob/v2.9.0/torch_xla/core/xla_model.py)."""
    if not world.distributed or world.grad_reduce == "ddp":
        return
    if world.is_xla:
        import torch_xla.core.xla_model as xm

        xm.reduce_gradients(optimizer)
        return
    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])  # one collective, not one per tensor
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    flat /= world.world_size
    for grad, reduced in zip(grads, flat.split([g.numel() for g in grads])):
        grad.copy_(reduced.view_as(grad))


def optimizer_step(world: World, optimizer: torch.optim.Optimizer, found_inf: torch.Tensor | None = None) -> None:
    """One optimizer step on gradients `reduce_gradients` has averaged.

    On XLA, `found_inf` (a device scalar, nonzero = skip) makes the sync-free AdamW skip the whole
    update inside the graph (torch_xla amp/syncfree/adamw.py,
    https://github.com/pytorch/xla/blob/v2.9.0/torch_xla/amp/syncfree/adamw.py): the host need not
    read the loss before the step. Eager backends
    check on the host before calling this, so `found_inf` must be None there."""
    if world.is_xla:
        cast(Any, optimizer).step(found_inf=found_inf)  # XlaAdamW (optim.py) takes it
    else:
        assert found_inf is None, "eager optimizers cannot skip in-graph; check the loss on the host"
        optimizer.step()


def device_batches(world: World, batches: Iterable[dict[str, torch.Tensor]]) -> Iterator[dict[str, torch.Tensor]]:
    """Batches on the device. On XLA, `MpDeviceLoader` uploads the next batches in a background
    thread while the device runs the current step."""
    if world.is_xla:
        import torch_xla.distributed.parallel_loader as pl

        yield from pl.MpDeviceLoader(batches, world.device)
        return
    non_blocking = world.backend == "cuda"
    for batch in batches:
        yield {k: v.to(world.device, non_blocking=non_blocking) for k, v in batch.items()}


def to_cpu(obj: Any) -> Any:
    """A copy of `obj` with every tensor moved to CPU (plain tensors: a checkpoint loads anywhere)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu")
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj


# ----------------------------------------------------------------------------- collectives (sanity)

def all_reduce_sum(world: World, tensor: torch.Tensor) -> torch.Tensor:
    if not world.distributed:
        return tensor
    if world.is_xla:
        import torch_xla.core.xla_model as xm

        return cast(torch.Tensor, xm.all_reduce(xm.REDUCE_SUM, tensor))  # one tensor in, one out
    out = tensor.clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out


def all_gather(world: World, tensor: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's `tensor` along dim 0."""
    if not world.distributed:
        return tensor
    if world.is_xla:
        import torch_xla.core.xla_model as xm

        return xm.all_gather(tensor, dim=0)
    parts = [torch.empty_like(tensor) for _ in range(world.world_size)]
    dist.all_gather(parts, tensor)
    return torch.cat(parts, dim=0)


def reduce_scatter_sum(world: World, tensor: torch.Tensor) -> torch.Tensor:
    """Sum `tensor` (dim 0 divisible by world size) over ranks; rank r keeps the r-th chunk."""
    if not world.distributed:
        return tensor
    if world.is_xla:
        import torch_xla.core.xla_model as xm

        return xm.reduce_scatter(xm.REDUCE_SUM, tensor, scale=1.0, scatter_dim=0, shard_count=world.world_size)
    chunks = list(tensor.chunk(world.world_size, dim=0))
    if world.backend == "cpu":
        # gloo has no reduce_scatter: all_reduce, then keep this rank's chunk.
        summed = tensor.clone()
        dist.all_reduce(summed, op=dist.ReduceOp.SUM)
        return summed.chunk(world.world_size, dim=0)[world.rank].clone()
    out = torch.empty_like(chunks[0])
    dist.reduce_scatter(out, [c.contiguous() for c in chunks], op=dist.ReduceOp.SUM)
    return out


# ----------------------------------------------------------------------------- XLA compile accounting

_compile_cache_open = False

def compile_count(world: World) -> int | None:
    """Graphs compiled so far in this process (torch_xla's `CompileTime` metric); None on eager."""
    if not world.is_xla:
        return None
    import torch_xla.debug.metrics as met

    data = met.metric_data("CompileTime")
    return int(data[0]) if data else 0


def host_transfers(world: World) -> int | None:
    """Device-to-host transfers so far in this process (torch_xla's `TransferFromDeviceTime`
    metric: every `.item()`, `.cpu()` or print of a device tensor); None on eager."""
    if not world.is_xla:
        return None
    import torch_xla.debug.metrics as met

    data = met.metric_data("TransferFromDeviceTime")
    return int(data[0]) if data else 0


def compile_cache_misses(world: World) -> int | None:
    """Graphs this process needed that were not in the persistent cache `initialize_compile_cache`
    opened (i.e. not traced by the `compile` step); None when no cache is in use."""
    if not world.is_xla or not _compile_cache_open:
        return None
    import torch_xla.debug.metrics as met

    return int(met.counter_value("PersistentCacheMiss") or 0)


def initialize_compile_cache(world: World, path: str) -> None:
    """Persist compiled XLA graphs under `path`, keyed by graph hash, so a later process (training
    after `compile`) finds them. PJRT's CPU client can serialize but not deserialize executables,
    so locally the cache is a ledger of traced graphs (a miss = a graph `compile` did not trace);
    on Neuron the Neuron persistent cache (NEURON_COMPILE_CACHE_URL) holds the compiled NEFFs."""
    global _compile_cache_open
    if world.is_xla and not neuron_available():
        import torch_xla.runtime as xr

        xr.initialize_cache(path, readonly=False)
        _compile_cache_open = True


def neuron_cache_url(base: str | None) -> str | None:
    """The Neuron persistent cache location for this compiler: `<base>/neuronx-cc-<version>/`.

    Keyed by compiler version so an image upgrade never loads NEFFs built by another neuronx-cc
    (https://awsdocs-neuron.readthedocs-hosted.com/en/latest/general/arch/neuron-features/neuron-caching.html).
    `compile` and `train` must agree on it, or training recompiles."""
    if not base:
        return None
    return f"{base.rstrip('/')}/neuronx-cc-{versions().get('neuronx-cc') or 'unknown'}/"


def configure_neuron_cache(base: str | None = None) -> str | None:
    """Point the Neuron runtime at the versioned cache (unless NEURON_COMPILE_CACHE_URL is set)."""
    url = neuron_cache_url(base or os.environ.get(COMPILE_CACHE_BASE_ENV))
    if url and neuron_available():
        os.environ.setdefault("NEURON_COMPILE_CACHE_URL", url)
    return os.environ.get("NEURON_COMPILE_CACHE_URL")
