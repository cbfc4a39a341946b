"""One local deployment, and the pipeline runs the scenarios share (the moto world lives for the
module that uses it: test_teams.py starts its own stage in an empty moto).

    e2e_stage          the dev stage, synthesized once
    e2e_world          the dev stage in moto with the local Batch (tests/e2e/world.py)
    first_run          an upload of the tiny demo data (catalog/v1); its Train job loses node 1
                       (SIGKILL of the node's processes) once the first checkpoint exists
    rejected_run       after first_run: an upload (catalog/v2) whose pairs match no query to its
                       product, so the incremental model is worse than the published one
    production_run     after rejected_run: a run started by hand on one node, with init_from = the
                       published model, on the v2 data (the gate rejects it): one process per job, so
                       Compile and Train run their definitions' commands unsubstituted (--backend xla,
                       the stage's precision and NEURON_CC_FLAGS) on PJRT CPU
    canary_run         the canary job as its schedule submits it
Each run takes a few minutes on 2 cores; every assertion about it reuses the same result.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline_steps.demo_data import write_demo
from tests.e2e.local_batch import Fault, JobRun
from tests.e2e.stage import Stage, synthesize
from pipeline_steps.contract import CHECKPOINTS_DIR, run_path
from tests.e2e.world import E2EWorld, RunResult, local_run_dir, one_node_run_input

PRESET = "tiny"
DATASET = "catalog"
KILLED_NODE = 1


def first_checkpoint_written(fsx_root: Path, parameters: dict[str, str]) -> bool:
    """A complete checkpoint: its manifest is written after the .pt (pipeline_steps/checkpoint.py)."""
    return any((local_run_dir(fsx_root, parameters["run_id"]) / CHECKPOINTS_DIR).glob("step-*.json"))


@pytest.fixture(scope="package")
def e2e_stage() -> Stage:
    return synthesize(PRESET)


@pytest.fixture(scope="module")
def e2e_world(tmp_path_factory, e2e_stage):
    with E2EWorld(tmp_path_factory.mktemp("e2e"), preset=PRESET, stage=e2e_stage) as world:
        yield world


@pytest.fixture(scope="package")
def demo_data(tmp_path_factory) -> Path:
    return write_demo(tmp_path_factory.mktemp("upload") / "v1", PRESET)


@pytest.fixture(scope="module")
def first_run(e2e_world, demo_data) -> RunResult:
    e2e_world.batch.faults.append(Fault("train", attempt=1, node_index=KILLED_NODE, ready=first_checkpoint_written))
    e2e_world.upload_dataset(DATASET, "v1", demo_data)
    result = e2e_world.wait_for_run(f"{DATASET}-v1")
    print("\n" + e2e_world.format_path(result))
    return result


def mismatched_pairs(source: Path, target: Path) -> Path:
    """The demo data with every query moved to another product (a fixed derangement): a model
    trained on it retrieves the wrong products for the holdout queries."""
    for path in source.rglob("*"):
        if path.is_file() and path.name != "_SUCCESS":
            out = target / path.relative_to(source)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(path.read_bytes())
    product_ids = [json.loads(line)["id"] for f in sorted((source / "products").glob("*.jsonl"))
                   for line in f.read_text().splitlines() if line.strip()]
    shifted = dict(zip(product_ids, product_ids[7:] + product_ids[:7]))
    for path in sorted((target / "pairs").glob("*.parquet")):
        table = pq.read_table(path).to_pylist()
        for row in table:
            row["product_id"] = shifted[row["product_id"]]
        random.Random(0).shuffle(table)
        pq.write_table(pa.Table.from_pylist(table, schema=pq.read_schema(path)), path)
    (target / "_SUCCESS").write_bytes(b"")
    return target


@dataclass
class RejectedRun:
    result: RunResult
    pointer_before: dict  # models/current.json before the upload


@pytest.fixture(scope="module")
def rejected_run(e2e_world, first_run, demo_data, tmp_path_factory) -> RejectedRun:
    pointer_before = e2e_world.read_json("artifacts_bucket", "models/current.json")
    data = mismatched_pairs(demo_data, tmp_path_factory.mktemp("upload") / "v2")
    e2e_world.upload_dataset(DATASET, "v2", data)
    result = e2e_world.wait_for_run(f"{DATASET}-v2")
    print("\n" + e2e_world.format_path(result))
    return RejectedRun(result, pointer_before)


@pytest.fixture(scope="module")
def production_run(e2e_world, rejected_run) -> RunResult:
    result = e2e_world.start_run(f"{DATASET}-v2-one-node",
                                 one_node_run_input(DATASET, "v2", init_from=run_path(f"{DATASET}-v1")))
    print("\n" + e2e_world.format_path(result))
    return result


@pytest.fixture(scope="module")
def canary_run(e2e_world, production_run) -> JobRun:
    return e2e_world.run_canary()
