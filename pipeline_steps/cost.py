"""What a run cost: Batch job time x node count x the instance's on-demand hourly price.

Used by the operator CLI (`trainium-runs status/runs`), by run-local's report (compute price 0) and
by each pipeline run's MLflow run. A price comes from an override (`--price INSTANCE=USD`), else the
AWS Price List API, else the committed table, else it is unknown (None), never guessed; each step
says which (`price_source`). Compute only, a lower bound of the bill: docs/operations.md, "Cost".
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

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


SOURCE_OVERRIDE = "override (--price)"
SOURCE_PRICE_LIST = "AWS Price List API"
SOURCE_LOCAL = "local (no compute price)"


class PriceList:
    """On-demand Linux prices from the AWS Price List Query API (`pricing:GetProducts`).

    The API is served from us-east-1 (also eu-central-1 and ap-south-1) whatever region is priced
    (https://docs.aws.amazon.com/awsaccountbilling/latest/aboutv2/using-price-list-query-api.html);
    the filters pick the one EC2 product a Batch instance is billed as: Linux, shared tenancy, no
    pre-installed software, no license, capacitystatus Used (a running instance, not a reservation).
    """

    def __init__(self, client: Any) -> None:
        self.client = client  # boto3.client("pricing", region_name="us-east-1")

    @classmethod
    def from_session(cls, session: Any) -> PriceList:
        return cls(session.client("pricing", region_name="us-east-1"))

    def filters(self, region: str, instance_type: str) -> list[dict[str, str]]:
        attrs = {"instanceType": instance_type, "regionCode": region, "operatingSystem": "Linux",
                 "tenancy": "Shared", "preInstalledSw": "NA", "licenseModel": "No License required",
                 "capacitystatus": "Used"}
        return [{"Type": "TERM_MATCH", "Field": k, "Value": v} for k, v in attrs.items()]

    def usd_per_hour(self, region: str, instance_type: str) -> float | None:
        """The on-demand USD/hour, or None when the API has no single such price (or is unreachable)."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            products = self.client.get_products(ServiceCode="AmazonEC2", FormatVersion="aws_v1", MaxResults=10,
                                                Filters=self.filters(region, instance_type))["PriceList"]
        except (BotoCoreError, ClientError) as exc:  # offline, no credentials, no pricing:GetProducts
            log.info("AWS Price List API unavailable (%s); using the committed price table", exc)
            return None
        prices = {float(dim["pricePerUnit"]["USD"])
                  for product in products
                  for term in json.loads(product)["terms"].get("OnDemand", {}).values()
                  for dim in term["priceDimensions"].values() if dim.get("unit") == "Hrs"}
        if len(prices) != 1:
            log.info("AWS Price List API: %d on-demand prices for %s in %s; using the committed table",
                     len(prices), instance_type, region)
            return None
        return prices.pop()


@dataclass
class PriceTable:
    """Hourly prices for one region: overrides (instance type -> USD/h), then the Price List API
    (when `price_list` is given), then the committed table. Each instance type is looked up once."""

    region: str
    overrides: Mapping[str, float] = field(default_factory=dict)
    price_list: PriceList | None = None
    _quotes: dict[str, tuple[float | None, str | None]] = field(default_factory=dict, repr=False)

    def quote(self, instance_type: str | None) -> tuple[float | None, str | None]:
        """(USD per hour, where it came from); (None, None) when no source has a price."""
        if instance_type is None:
            return None, None
        if instance_type not in self._quotes:
            self._quotes[instance_type] = self._lookup(instance_type)
        return self._quotes[instance_type]

    def _lookup(self, instance_type: str) -> tuple[float | None, str | None]:
        if instance_type in self.overrides:
            return float(self.overrides[instance_type]), SOURCE_OVERRIDE
        if self.price_list is not None:
            live = self.price_list.usd_per_hour(self.region, instance_type)
            if live is not None:
                return live, SOURCE_PRICE_LIST
        table = ON_DEMAND_USD_PER_HOUR.get(self.region, {}).get(instance_type)
        return (table, f"committed table ({PRICE_SOURCES[self.region]})") if table is not None else (None, None)

    def price(self, instance_type: str | None) -> float | None:
        return self.quote(instance_type)[0]

    def source(self, instance_type: str | None) -> str | None:
        return self.quote(instance_type)[1]


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
    price_source: str | None = None

    @property
    def cost_usd(self) -> float | None:
        if self.usd_per_hour is None:
            return None
        return node_hours(self.seconds, self.nodes) * self.usd_per_hour

    def as_dict(self) -> dict[str, Any]:
        cost = self.cost_usd
        return {"step": self.step, "instance_type": self.instance_type, "nodes": self.nodes,
                "seconds": round(self.seconds, 3), "usd_per_hour": self.usd_per_hour,
                "cost_usd": None if cost is None else round(cost, 4), "running": self.running,
                "price_source": self.price_source}


def node_hours(seconds: float, nodes: int) -> float:
    return max(seconds, 0.0) / 3600.0 * nodes


def step_cost(step: str, *, instance_type: str | None, nodes: int, started_at: float | None,
              stopped_at: float | None, prices: PriceTable, now: float | None = None) -> StepCost:
    """Cost of one Batch job; timestamps in epoch seconds. Not started = 0 s; no stop = running."""
    price, source = prices.quote(instance_type)
    if started_at is None:
        return StepCost(step, instance_type, nodes, 0.0, price, price_source=source)
    end = stopped_at if stopped_at is not None else (time.time() if now is None else now)
    return StepCost(step, instance_type, nodes, end - started_at, price, running=stopped_at is None,
                    price_source=source)


@dataclass(frozen=True)
class GpuComparison:
    """Cost per unit of work on Trainium vs a GPU instance: price / throughput on each side.

    Defaults are the seeds' benchmark (BERT-base fine-tune, SageMaker prices): ml.trn1.32xlarge
    24.725 $/h at 6.64 it/s vs ml.p4d.24xlarge 37.69 $/h at 5.44 it/s -> Trainium does the same
    work for 0.537x the GPU's cost (Amazon Search's M5 team reported 30% lower training cost)."""

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
        "price_sources": sorted({s.price_source for s in steps if s.price_source}),
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
    steps = [StepCost(name, "local", 1, seconds, 0.0, price_source=SOURCE_LOCAL) for name, seconds in step_seconds]
    return run_cost(steps, comparison=None)
