"""Two teams share the dev stage (search and ads, scripts/stage_synth.py teams_stage_config): a
host boots from the synthesized launch template, whose user data gives each team's FSx runs
directory its project quota (through an `lfs` that enforces it: tests/e2e/lustre_quota.py); team
search's directory is then full. Both teams upload the same data version at once: search's run fails
at its first write with the failure class storage_error, ads's run goes on and publishes its model,
each in its own paths. ~3 minutes on 2 cores (one full run)."""

from __future__ import annotations

import errno
import os
import subprocess
import sys

import pytest

from pipeline_contract import CHECKPOINTS_DIR, run_path
from scripts.stage_synth import teams_stage_config
from stacks.team_config import MIN_QUOTA_GIB
from tests.e2e.conftest import DATASET, PRESET
from tests.e2e.stage import synthesize
from tests.e2e.world import E2EWorld, local_run_dir
from tests.infra.node_boot import boot, boot_scripts

pytestmark = pytest.mark.slow
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HOST = "trn1.2xlarge"


def _tmpfs_mounts_here(path) -> bool:
    probe = path / "probe"
    probe.mkdir()
    mounted = subprocess.run(["/usr/bin/mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(probe)],
                             capture_output=True, check=False).returncode == 0
    if mounted:
        subprocess.run(["/usr/bin/umount", str(probe)], check=True)
    return mounted


def fill(directory, at_most: int = 64 * 1024 * 1024) -> int:
    """Write a previous run's leftovers into `directory` until the file system refuses; bytes written.
    Past `at_most` the directory has no quota (the boot did not set it): stop, and fail."""
    directory.mkdir(parents=True)
    written = 0
    try:
        with open(directory / "leftovers.bin", "wb") as fh:
            while written < at_most:
                fh.write(b"\0" * 65536)
                fh.flush()
                written += 65536
    except OSError as exc:
        assert exc.errno == errno.ENOSPC, exc
        return written
    raise AssertionError(f"{directory} took {at_most} bytes: no quota on it")


@pytest.fixture(scope="module")
def teams(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("teams")
    if not _tmpfs_mounts_here(tmp):
        pytest.skip("the quota stand-in mounts tmpfs (root with CAP_SYS_ADMIN); this machine refuses it")
    config = teams_stage_config(search=MIN_QUOTA_GIB, ads=1)
    stage = synthesize(PRESET, config=config)
    lfs = f'#!/bin/sh\nLFS_STATE="{tmp}/lfs.json" exec "{sys.executable}" "{REPO}/tests/e2e/lustre_quota.py" "$@"\n'
    host = boot(boot_scripts(stage.templates["compute"])[HOST], HOST, tmp, tools={"lfs": lfs},
                driver=f"{config.compute.min_neuron_driver_version}.0")
    try:
        assert host.exit_code == 0 and host.agent_starts, host.console
        with E2EWorld(tmp / "root", preset=PRESET, stage=stage) as world:
            yield world, config
    finally:
        for team in config.teams:
            subprocess.run(["/usr/bin/umount", "-l", str(tmp / "root" / "fsx" / "runs" / team.name)], check=False)


@pytest.fixture(scope="module")
def runs(teams, demo_data):
    world, _ = teams
    full = fill(local_run_dir(world.batch.setup.fsx_root, "search/catalog-v0"))
    for team in ("search", "ads"):
        world.upload_dataset(DATASET, "v1", demo_data, team=team)
    results = {team: world.wait_for_run(f"{DATASET}-v1", team=team) for team in ("search", "ads")}
    for result in results.values():
        print("\n" + world.format_path(result))
    return results, world.notifications(), full


def test_the_full_teams_run_fails_at_its_first_write_with_the_storage_class(teams, runs):
    (_, config), (results, notifications, full) = teams, runs
    assert full == 1024 * 1024 == config.teams[0].fsx_quota_kib * 1024  # the boot applied the team's quota
    search = results["search"]
    assert search.status == "FAILED"
    assert search.visited[-4:] == ["DiagnoseFailure", "NotifyFailureMessage", "NotifyFailure", "Failed"]
    (prepare,) = search.jobs
    assert prepare.definition == "prepare" and prepare.attempts[-1].exit_code == 1
    assert "No space left on device" in prepare.attempts[-1].logs[0].read_text()
    (failure,) = [n for n in notifications if f"search/{DATASET}-v1 failed" in n]
    assert "Class: storage_error" in failure and "No space left on device" in failure


def test_the_other_teams_run_goes_on_in_its_own_paths_and_publishes_its_own_model(teams, runs):
    (world, _), (results, notifications, _) = teams, runs
    ads = results["ads"]
    assert ads.status == "SUCCEEDED"
    assert ads.visited[-4:] == ["Publish", "NotifyPublishedMessage", "NotifyPublished", "Done"]
    assert {job.parameters["run_id"] for job in ads.jobs} == {f"ads/{DATASET}-v1"}
    assert {job.parameters["data_uri"] for job in ads.jobs if job.definition == "prepare"} == \
        {f"/fsx/data/incoming/ads/{DATASET}/v1"}
    pointer = world.read_json("artifacts_bucket", "models/ads/current.json")
    assert pointer["run_id"] == f"ads/{DATASET}-v1" and pointer["checkpoint"] == run_path(f"ads/{DATASET}-v1")
    assert any((world.run_dir(f"ads/{DATASET}-v1") / CHECKPOINTS_DIR).glob("step-*.pt"))
    assert "models/search/current.json" not in {o["Key"] for o in world.s3.list_objects_v2(
        Bucket=world.buckets["artifacts_bucket"]).get("Contents", [])}
    assert any(f"ads/{DATASET}-v1 published models/ads/current.json" in n for n in notifications)
