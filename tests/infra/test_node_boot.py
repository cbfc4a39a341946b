"""Boot every host type: each launch template's user data, taken from the synthesized template, runs
on a fake host (tests/infra/node_boot.py) for every instance type a compute environment launches:
FSx is mounted before the ECS agent starts, or the host takes itself out of service and says why;
with teams, every host applies each team's Lustre project quota once FSx is mounted.
"""

from __future__ import annotations

import pytest

from node_boot import FSX_SOURCE, HARDWARE, boot, boot_scripts


@pytest.fixture(scope="module")
def scripts(dev_templates, prod_templates) -> dict[tuple[str, str], str]:
    out = {}
    for stage, templates in (("dev", dev_templates), ("prod", prod_templates)):
        for instance_type, script in boot_scripts(templates["compute"].to_json()).items():
            out[stage, instance_type] = script
    return out


@pytest.fixture(scope="module")
def min_driver(prod_config) -> str:
    return prod_config.compute.min_neuron_driver_version


def test_every_instance_type_a_compute_environment_launches_is_rehearsed(scripts):
    assert {instance_type for _, instance_type in scripts} == set(HARDWARE)


@pytest.mark.parametrize("stage, instance_type", [("dev", "trn1.32xlarge"), ("dev", "trn1.2xlarge"),
                                                  ("prod", "trn1n.32xlarge"), ("prod", "trn1.2xlarge")])
def test_each_host_type_mounts_fsx_before_the_agent_starts(scripts, min_driver, tmp_path, stage, instance_type):
    result = boot(scripts[stage, instance_type], instance_type, tmp_path, driver=f"{min_driver}.0")
    assert result.exit_code == 0, result
    assert result.agent_starts and result.mounts == ["/fsx"]
    (mount,) = result.called("mount")
    assert mount.split()[1:5] == ["-t", "lustre", "-o", "noatime,flock"] and FSX_SOURCE in mount
    assert result.called("dnf") == ["dnf install -y lustre-client"] and not result.called("shutdown")
    # Reboots: fstab mounts FSx again and the agent's unit requires that mount.
    assert f"{FSX_SOURCE} /fsx lustre defaults,noatime,flock,_netdev 0 0" in (result.root / "etc/fstab").read_text()
    (drop_in,) = (result.root / "etc/systemd/system/ecs.service.d").glob("*.conf")
    assert "RequiresMountsFor=/fsx" in drop_in.read_text()


@pytest.mark.parametrize("key, hardware, driver, faults, reason", [
    (("prod", "trn1.2xlarge"), "trn1.2xlarge", "ok", {"FAIL_MOUNT": "1"},
     f"mount of {FSX_SOURCE} failed 10 times"),
    (("prod", "trn1n.32xlarge"), "trn1n.32xlarge", "ok", {"FAIL_DNF": "1"}, "dnf install lustre-client failed"),
    (("prod", "trn1n.32xlarge"), "trn1n.32xlarge", "2.21.37.0", {}, "Neuron driver 2.21.37.0 < "),
    (("dev", "trn1.2xlarge"), "trn1.2xlarge", None, {}, "Neuron driver 0 < "),
    # trn1.32xlarge hardware with the trn1n template: 8 EFA interfaces where 16 are expected.
    (("prod", "trn1n.32xlarge"), "trn1.32xlarge", "ok", {}, "found 8 EFA devices (uverbs), expected 16"),
    (("dev", "trn1.32xlarge"), "trn1.2xlarge", "ok", {}, "found 1 /dev/neuron*, expected 16"),
])
def test_a_host_that_cannot_serve_takes_itself_out_of_service_and_says_why(
        scripts, min_driver, tmp_path, key, hardware, driver, faults, reason):
    result = boot(scripts[key], hardware, tmp_path, driver=f"{min_driver}.0" if driver == "ok" else driver, **faults)
    assert result.exit_code != 0 and not result.agent_starts
    assert f"trainium-node-init FATAL: {reason}" in result.console
    assert result.called("shutdown") == ["shutdown -h now"] and "systemctl stop --no-block ecs" in result.calls
    assert result.mounts == [] and not (result.root / "etc/fstab").exists()


@pytest.mark.parametrize("killed_at", ["dnf", "mount"])
def test_a_boot_script_killed_midway_leaves_the_agent_unable_to_start(scripts, min_driver, tmp_path, killed_at):
    # No shutdown ran (the script died), but the agent's unit still refuses to start without FSx.
    result = boot(scripts["prod", "trn1n.32xlarge"], "trn1n.32xlarge", tmp_path, driver=f"{min_driver}.0",
                  KILL_AT=killed_at)
    assert not result.called("shutdown") and not result.agent_starts


# ---- teams: every host applies each team's Lustre project quota once FSx is mounted ----------------
@pytest.fixture(scope="module")
def teams_scripts(teams_templates) -> dict[str, str]:
    return boot_scripts(teams_templates["TrnEmbed-dev-Compute"])


@pytest.fixture(scope="module")
def teams(teams_app_and_stage):
    from infra_synth import teams_stage_config

    return teams_stage_config().teams


@pytest.mark.parametrize("instance_type", ["trn1.32xlarge", "trn1.2xlarge"])
def test_a_host_applies_every_teams_project_quota_after_mounting_fsx(teams_scripts, teams, min_driver, tmp_path,
                                                                      instance_type):
    result = boot(teams_scripts[instance_type], instance_type, tmp_path, driver=f"{min_driver}.0")
    assert result.exit_code == 0 and result.agent_starts, result
    lfs = result.called("lfs")
    root = result.root
    expected = []
    for team in teams:
        directory = f"{root}/fsx/runs/{team.name}"
        expected += [f"lfs project -d {directory}", f"lfs project -p {team.project_id} -r -s {directory}",
                     f"lfs setquota -p {team.project_id} -b 0 -B {team.fsx_quota_kib} -i 0 -I 0 {root}/fsx"]
        assert (root / "fsx" / "runs" / team.name).is_dir()
    assert lfs == expected
    assert result.calls.index(next(c for c in result.calls if c.startswith("mount "))) < result.calls.index(lfs[0])


def test_a_directory_already_in_its_project_is_not_walked_again(teams_scripts, teams, min_driver, tmp_path):
    (search, _) = teams
    result = boot(teams_scripts["trn1.2xlarge"], "trn1.2xlarge", tmp_path, driver=f"{min_driver}.0",
                  LFS_PROJECT=str(search.project_id))
    assert not [c for c in result.called("lfs") if f"-p {search.project_id} -r" in c]
    assert [c for c in result.called("lfs") if c.startswith(f"lfs setquota -p {search.project_id} ")]


def test_a_host_that_cannot_set_a_quota_takes_itself_out_of_service(teams_scripts, min_driver, tmp_path):
    result = boot(teams_scripts["trn1.2xlarge"], "trn1.2xlarge", tmp_path, driver=f"{min_driver}.0", FAIL_LFS="1")
    assert result.exit_code != 0 and not result.agent_starts
    assert "trainium-node-init FATAL: lfs project -p " in result.console
    assert result.called("shutdown") == ["shutdown -h now"]


def test_a_stage_without_teams_sets_no_quota(scripts, min_driver, tmp_path):
    result = boot(scripts["dev", "trn1.2xlarge"], "trn1.2xlarge", tmp_path, driver=f"{min_driver}.0")
    assert result.exit_code == 0 and not result.called("lfs")
