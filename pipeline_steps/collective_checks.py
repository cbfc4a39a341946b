"""The sanity step's device and collective checks: a matmul, all_reduce, all_gather and
reduce_scatter of values whose results are known exactly, timed over several iterations."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping

import torch

from . import distributed
from .errors import BadConfigError
from .health_report import FAILED, PASSED, Check

# PIPELINE_SANITY_FAULT_RANK=<r>: rank r contributes a wrong all_reduce value (tests the detection path).
FAULT_RANK_ENV = "PIPELINE_SANITY_FAULT_RANK"
COLLECTIVE_CHECKS = ("all_reduce", "all_gather", "reduce_scatter")

# Payload sizes (elements of fp32). Values are built so every partial sum is an integer below 2**24:
# exact in fp32 in any reduction order, so results compare exactly.
MATMUL_N = 128
ALL_REDUCE_NUMEL = 1 << 18  # 1 MiB: enough to time, small enough for gloo on a laptop
ALL_GATHER_NUMEL = 1024  # per rank
REDUCE_SCATTER_NUMEL = 1024  # per rank (the input is world_size times this)


def fault_rank(environ: Mapping[str, str]) -> int | None:
    value = environ.get(FAULT_RANK_ENV, "").strip()
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise BadConfigError(f"{FAULT_RANK_ENV}={value!r} is not a rank number; unset it") from None


def rank_weight(rank: int) -> int:
    """a(r) = r % 7 + 1: small and rank-dependent, so sums stay exact and a missing or swapped
    contribution changes the result."""
    return rank % 7 + 1


def sum_rank_weights(world_size: int) -> int:
    """S(W) = sum of a(r) for r < W, in closed form (1+..+7 = 28 per full cycle of 7 ranks)."""
    cycles, rest = divmod(world_size, 7)
    return 28 * cycles + rest * (rest + 1) // 2


def compare(expected: torch.Tensor, actual: torch.Tensor, *, atol: float = 0.0, rtol: float = 0.0,
            show: int = 4) -> tuple[bool, str, str, str]:
    """(ok, expected, actual, detail) with the values shown from the first mismatching index."""
    actual = actual.detach().to("cpu", torch.float64).reshape(-1)
    expected = expected.detach().to("cpu", torch.float64).reshape(-1)
    if actual.shape != expected.shape:
        return False, f"shape {list(expected.shape)}", f"shape {list(actual.shape)}", "wrong shape"
    bad = ~((actual - expected).abs() <= atol + rtol * expected.abs())  # NaN counts as bad
    num_bad = int(bad.sum())
    first = int(bad.nonzero()[0, 0]) if num_bad else 0

    def window(t: torch.Tensor) -> str:
        values = ", ".join(f"{v:g}" for v in t[first:first + show].tolist())
        return f"x[{first}:{first + show}]=[{values}]"

    detail = f"{num_bad} of {expected.numel()} elements differ" if num_bad else ""
    return num_bad == 0, window(expected), window(actual), detail


def _timed(world: distributed.World, iterations: int, op: Callable[[], torch.Tensor]
           ) -> tuple[list[torch.Tensor], list[float]]:
    """Run `op` `iterations` times, each time through to a CPU tensor (which waits for the device
    and, on XLA, compiles and runs the graph); returns every result's CPU copy and per-run seconds."""
    results: list[torch.Tensor] = []
    seconds: list[float] = []
    for _ in range(iterations):
        start = time.perf_counter()
        out = op()
        distributed.mark_step(world)
        results.append(distributed.to_cpu(out))
        seconds.append(time.perf_counter() - start)
    return results, seconds


def _timing(seconds: list[float], payload_bytes: int | None = None) -> str:
    median = statistics.median(seconds)
    text = f"{len(seconds)} runs, median {median * 1000:.2f} ms, max {max(seconds) * 1000:.2f} ms"
    if payload_bytes:
        text += f", {payload_bytes / median / 1e9:.3f} GB/s algbw"
    return text


def _first_bad(results: list[torch.Tensor], expected: torch.Tensor) -> Check | None:
    for i, result in enumerate(results):
        ok, exp, act, detail = compare(expected, result, atol=0.5)
        if not ok:
            return Check("", FAILED, exp, act, detail=f"run {i + 1} of {len(results)}: {detail}")
    return None


def check_matmul(world: distributed.World, iterations: int) -> Check:
    # A[i,k] = i%8+1 and B[k,j] = j%8+1, so (A @ B)[i,j] = n * (i%8+1) * (j%8+1): integers <= 8192.
    n = MATMUL_N
    rows = (torch.arange(n) % 8 + 1).float()
    a = rows[:, None].expand(n, n).contiguous().to(world.device)
    b = rows[None, :].expand(n, n).contiguous().to(world.device)
    expected = n * rows[:, None] * rows[None, :]
    results, seconds = _timed(world, iterations, lambda: a @ b)
    bad = _first_bad(results, expected)
    if bad:
        bad.name = "device_matmul"
        return bad
    return Check("device_matmul", PASSED, "C[i,j] = 128*(i%8+1)*(j%8+1)", "equal",
                 detail=f"{n}x{n} fp32 on {world.device}; {_timing(seconds)}")


def check_all_reduce(world: distributed.World, iterations: int, faulty_rank: int | None) -> Check:
    # x_r[i] = a(r) * (i%13+1); the sum over ranks is S(W) * (i%13+1).
    pattern = (torch.arange(ALL_REDUCE_NUMEL) % 13 + 1).float()
    contribution = rank_weight(world.rank) * pattern
    if faulty_rank == world.rank:
        contribution = contribution + 1000.0  # the injected fault: this rank's value is wrong
    expected = sum_rank_weights(world.world_size) * pattern
    x = contribution.to(world.device)
    results, seconds = _timed(world, iterations, lambda: distributed.all_reduce_sum(world, x))
    bad = _first_bad(results, expected)
    if bad:
        bad.name = "all_reduce"
        bad.detail += "; a rank contributed a wrong value or the reduction is broken"
        return bad
    return Check("all_reduce", PASSED, f"x[i] = {sum_rank_weights(world.world_size)}*(i%13+1)", "equal",
                 detail=f"{ALL_REDUCE_NUMEL} fp32 over {world.world_size} ranks; "
                        f"{_timing(seconds, ALL_REDUCE_NUMEL * 4 if world.distributed else None)}")


def check_all_gather(world: distributed.World, iterations: int) -> Check:
    # Rank r contributes [r*m, (r+1)*m); the gathered tensor is 0, 1, ..., W*m-1.
    m = ALL_GATHER_NUMEL
    x = (torch.arange(m) + world.rank * m).float().to(world.device)
    expected = torch.arange(m * world.world_size).float()
    results, seconds = _timed(world, iterations, lambda: distributed.all_gather(world, x))
    bad = _first_bad(results, expected)
    if bad:
        bad.name = "all_gather"
        return bad
    return Check("all_gather", PASSED, f"0..{m * world.world_size - 1}", "equal",
                 detail=f"{m} fp32 per rank; {_timing(seconds)}")


def check_reduce_scatter(world: distributed.World, iterations: int) -> Check:
    # Rank r contributes z_r[k] = a(r) * (k%1021+1) over W*m elements; rank r keeps chunk r of the
    # sum, S(W) * (k%1021+1) for k in [r*m, (r+1)*m) (1021 is prime, so chunks differ by rank).
    m, w = REDUCE_SCATTER_NUMEL, world.world_size
    pattern = (torch.arange(m * w) % 1021 + 1).float()
    x = (rank_weight(world.rank) * pattern).to(world.device)
    expected = sum_rank_weights(w) * pattern[world.rank * m:(world.rank + 1) * m]
    results, seconds = _timed(world, iterations, lambda: distributed.reduce_scatter_sum(world, x))
    bad = _first_bad(results, expected)
    if bad:
        bad.name = "reduce_scatter"
        return bad
    return Check("reduce_scatter", PASSED, f"chunk {world.rank}: {sum_rank_weights(w)}*(k%1021+1)", "equal",
                 detail=f"{m} fp32 per rank; {_timing(seconds)}")
