"""What a run cost: Batch job time x node count x the instance's on-demand hourly price.

Used by the operator CLI (`trainium-runs status/runs`, pipeline_ops/), by run-local's report
(compute price 0 locally, real durations) and by the MLflow run of each pipeline run.

    cost of a step = seconds between the job's startedAt and stoppedAt (or now, while it runs)
                     / 3600 x nodes x USD per instance-hour

This is compute only, priced on demand (what Batch launches for multi-node jobs: Spot is not
supported for them). It leaves out FSx, S3, NAT, instance boot time before the container starts
and the time a node idles between jobs, so it is a lower bound of the bill, good for comparing runs.

Prices: `ON_DEMAND_USD_PER_HOUR` holds only prices we can cite (PRICE_SOURCES). A region or
instance type not in the table has no price: its cost shows as unknown (None) rather than a guess;
pass it with `--price INSTANCE=USD` (CLI) or `PriceTable(overrides=...)`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Mapping

# ---- prices ------------------------------------------------------------------------------------
# Linux, shared tenancy, On-Demand, USD per instance-hour, from the AWS Price List bulk API
# (https://pricing.us-east-1.amazonaws.com/offers/v1.0/aws/AmazonEC2/current/us-east-1/index.csv,
# publication 20260728175247, filter TermType=OnDemand, OS=Linux, Tenancy=Shared,
# CapacityStatus=Used, MarketOption=OnDemand). trn1.32xlarge at 21.50 $/h is also quoted by
# https://www.usage.ai/blogs/aws/ai-ml-cost/trainium-vs-gpu-instances/ (June 2026).
# NOT in the table because we could not cite them: trn1.2xlarge (the single-node steps' instance)
# and every region other than us-east-1. Add them with a source, or override at run time.
ON_DEMAND_USD_PER_HOUR: Mapping[str, Mapping[str, float]] = {
    "us-east-1": {
        "trn1.32xlarge": 21.50,
        "trn1n.32xlarge": 24.78,
        "p4d.24xlarge": 21.957642,
    },
}
PRICE_SOURCES: Mapping[str, str] = {
    "us-east-1": "AWS Price List API, AmazonEC2 us-east-1 On-Demand Linux, publication 2026-07-28",
}


@dataclass(frozen=True)
class PriceTable:
    """Hourly prices for one region; `overrides` (instance type -> USD/h) win over the table."""

    region: str
    overrides: Mapping[str, float] = field(default_factory=dict)

    def price(self, instance_type: str | None) -> float | None:
        if instance_type is None:
            return None
        if instance_type in self.overrides:
            return float(self.overrides[instance_type])
        return ON_DEMAND_USD_PER_HOUR.get(self.region, {}).get(instance_type)


def parse_overrides(items: list[str] | None) -> dict[str, float]:
    """["trn1.2xlarge=1.34", ...] -> {"trn1.2xlarge": 1.34}; ValueError with the expected form."""
    out: dict[str, float] = {}
    for item in items or []:
        name, sep, value = item.partition("=")
        try:
            price = float(value)
        except ValueError:
            price = -1.0
        if not sep or not name or price < 0:
            raise ValueError(f"price {item!r}: use INSTANCE_TYPE=USD_PER_HOUR, e.g. trn1.2xlarge=1.34")
        out[name.strip()] = price
    return out


# ---- per step and per run ----------------------------------------------------------------------
@dataclass
class StepCost:
    step: str
    instance_type: str | None
    nodes: int
    seconds: float
    usd_per_hour: float | None
    running: bool = False

    @property
    def cost_usd(self) -> float | None:
        if self.usd_per_hour is None:
            return None
        return node_hours(self.seconds, self.nodes) * self.usd_per_hour

    def as_dict(self) -> dict[str, Any]:
        cost = self.cost_usd
        return {"step": self.step, "instance_type": self.instance_type, "nodes": self.nodes,
                "seconds": round(self.seconds, 3), "usd_per_hour": self.usd_per_hour,
                "cost_usd": None if cost is None else round(cost, 4), "running": self.running}


def node_hours(seconds: float, nodes: int) -> float:
    return max(seconds, 0.0) / 3600.0 * nodes


def step_cost(step: str, *, instance_type: str | None, nodes: int, started_at: float | None,
              stopped_at: float | None, prices: PriceTable, now: float | None = None) -> StepCost:
    """Cost of one Batch job; timestamps in epoch seconds. Not started = 0 s; no stop = running."""
    if started_at is None:
        return StepCost(step, instance_type, nodes, 0.0, prices.price(instance_type))
    end = stopped_at if stopped_at is not None else (time.time() if now is None else now)
    return StepCost(step, instance_type, nodes, end - started_at, prices.price(instance_type),
                    running=stopped_at is None)


@dataclass(frozen=True)
class GpuComparison:
    """Cost per unit of work on Trainium vs a GPU instance: price / throughput on each side.

    Defaults are the seeds' benchmark (BERT-base fine-tune, SageMaker prices): ml.trn1.32xlarge
    24.725 $/h at 6.64 it/s vs ml.p4d.24xlarge 37.69 $/h at 5.44 it/s -> Trainium does the same
    work for 0.537x the GPU's cost (DESIGN.md section 6)."""

    trainium_instance: str = "ml.trn1.32xlarge"
    trainium_usd_per_hour: float = 24.725
    trainium_throughput: float = 6.64
    gpu_instance: str = "ml.p4d.24xlarge"
    gpu_usd_per_hour: float = 37.69
    gpu_throughput: float = 5.44

    @property
    def cost_ratio(self) -> float:
        """Trainium cost per unit of work / GPU cost per unit of work (< 1: Trainium is cheaper)."""
        trn = self.trainium_usd_per_hour / self.trainium_throughput
        gpu = self.gpu_usd_per_hour / self.gpu_throughput
        return trn / gpu

    def compare(self, trainium_cost_usd: float | None) -> dict[str, Any]:
        """The same training work on the GPU: its cost and the saving, from a Trainium cost."""
        out: dict[str, Any] = {"gpu_instance": self.gpu_instance, "trainium_instance": self.trainium_instance,
                               "cost_ratio": round(self.cost_ratio, 4),
                               "throughput_ratio": round(self.trainium_throughput / self.gpu_throughput, 4)}
        if trainium_cost_usd is not None:
            gpu = trainium_cost_usd / self.cost_ratio
            out.update(trainium_cost_usd=round(trainium_cost_usd, 4), gpu_cost_usd=round(gpu, 4),
                       saving_usd=round(gpu - trainium_cost_usd, 4))
        return out


def run_cost(steps: list[StepCost], *, comparison: GpuComparison | None = None,
             training_steps: tuple[str, ...] = ("train",)) -> dict[str, Any]:
    """Totals of a run. `total_usd` sums the priced steps; `unpriced` names the steps without a
    price (the total is then a lower bound). The GPU comparison covers the training steps only:
    the seeds' throughput ratio is a training benchmark."""
    priced = [s for s in steps if s.cost_usd is not None]
    unpriced = [s.step for s in steps if s.cost_usd is None]
    total = sum(s.cost_usd or 0.0 for s in priced)
    out: dict[str, Any] = {
        "currency": "USD",
        "total_usd": round(total, 4),
        "node_hours": round(sum(node_hours(s.seconds, s.nodes) for s in steps), 4),
        "seconds": round(sum(s.seconds for s in steps), 3),
        "unpriced": unpriced,
        "running": any(s.running for s in steps),
        "steps": [s.as_dict() for s in steps],
    }
    if comparison is not None:
        train = [s for s in steps if s.step.lower() in training_steps]
        train_cost = sum(s.cost_usd for s in train if s.cost_usd is not None) if train else None
        out["gpu_comparison"] = comparison.compare(train_cost)
    return out


def local_cost(step_seconds: list[tuple[str, float]]) -> dict[str, Any]:
    """run-local's cost block: the same fields as on AWS, real durations, compute price 0."""
    steps = [StepCost(name, "local", 1, seconds, 0.0) for name, seconds in step_seconds]
    return run_cost(steps, comparison=None)
