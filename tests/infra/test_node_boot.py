"""Boot every host type: each launch template's user data, taken from the synthesized template (the
MIME document EC2 receives), runs under bash against a fake root (device files, sysfs, /etc) with
recording stand-ins for the commands that change a host (dnf, mount, systemctl, shutdown, ...).

After the script, systemd starts the ECS agent unless the host shut down, and only if the agent
unit's ExecStartPre guards pass. Every boot asserts that the agent never starts with /fsx unmounted.
PATH holds only the stand-ins and a few read-only tools, so nothing reaches this machine's host.
"""

from __future__ import annotations

import base64
import email
import json
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

# The hardware, independent of the instance table the templates are generated from: Neuron devices
# (/dev/neuron*) and EFA interfaces (/dev/infiniband/uverbs*) (https://aws.amazon.com/ec2/instance-types/trn1/).
HARDWARE = {"trn1.32xlarge": (16, 8), "trn1n.32xlarge": (16, 16), "trn1.2xlarge": (1, 0)}
FSX_ID, FSX_MOUNT_NAME = "fs-0123456789abcdef0", "abcdefgh"
FSX_SOURCE = f"{FSX_ID}.fsx.us-east-1.amazonaws.com@tcp:/{FSX_MOUNT_NAME}"
READ_ONLY_TOOLS = ("cat", "sort", "head", "tee", "mkdir", "seq", "grep")
STANDIN = r"""#!/bin/bash
name="${0##*/}"
echo "$name $*" >> "$BOOT_CALLS"
[ "$name" != "${KILL_AT:-}" ] || { kill -9 "$PPID"; exit 137; }
case "$name" in
  dnf) [ -z "${FAIL_DNF:-}" ] ;;
  mount) [ -z "${FAIL_MOUNT:-}" ] || exit 32
         target="${*: -1}"; echo "${target#"$TRAINIUM_NODE_ROOT"}" >> "$BOOT_MOUNTS" ;;
  mountpoint) target="${*: -1}"; grep -qxF -- "${target#"$TRAINIUM_NODE_ROOT"}" "$BOOT_MOUNTS" 2>/dev/null ;;
  modinfo) exit 1 ;;
  logger) cat > /dev/null ;;
esac
"""
STANDINS = ("dnf", "mount", "mountpoint", "modinfo", "logger", "systemctl", "shutdown", "sleep")


def _resolve(token) -> str:
    """A CloudFormation value as EC2 receives it; the file system's id and mount name are placeholders."""
    if isinstance(token, str):
        return token
    if "Fn::Join" in token:
        sep, parts = token["Fn::Join"]
        return sep.join(_resolve(p) for p in parts)
    if "Fn::Base64" in token:
        return base64.b64encode(_resolve(token["Fn::Base64"]).encode()).decode()
    if token == {"Ref": "AWS::URLSuffix"}:
        return "amazonaws.com"
    reference = json.dumps(token)
    for marker, value in (("MountName", FSX_MOUNT_NAME), ("LustreFileSystem", FSX_ID)):
        if marker in reference:
            return value
    raise KeyError(f"user data references {reference}: give the boot rehearsal a value for it")


def boot_scripts(template: dict) -> dict[str, str]:
    """Instance type -> the shell part of the user data of the launch template its compute
    environment launches it with."""
    resources = template["Resources"]
    scripts = {}
    for ce in (r for r in resources.values() if r["Type"] == "AWS::Batch::ComputeEnvironment"):
        compute = ce["Properties"]["ComputeResources"]
        template_id = compute["LaunchTemplate"]["LaunchTemplateId"]["Ref"]
        user_data = resources[template_id]["Properties"]["LaunchTemplateData"]["UserData"]
        document = email.message_from_string(_resolve(user_data["Fn::Base64"]))
        (script,) = [part.get_payload(decode=True).decode() for part in document.walk()
                     if part.get_content_type() == "text/x-shellscript"]
        for instance_type in compute["InstanceTypes"]:
            scripts[instance_type] = script
    return scripts


@dataclass
class Boot:
    exit_code: int
    calls: list[str]
    console: str
    mounts: list[str]
    agent_starts: bool
    root: Path

    def called(self, command: str) -> list[str]:
        return [c for c in self.calls if c.split()[0] == command]


def _bin(tmp: Path) -> Path:
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    standin = bin_dir / "standin"
    standin.write_text(STANDIN)
    standin.chmod(0o755)
    for name in STANDINS:
        (bin_dir / name).symlink_to(standin)
    for tool in READ_ONLY_TOOLS:
        (bin_dir / tool).symlink_to(shutil.which(tool))
    return bin_dir


def _host(root: Path, instance_type: str, driver: str | None) -> None:
    neuron, efa = HARDWARE[instance_type]
    for directory in ("dev", "etc", "var/log", "sys/module/neuron"):
        (root / directory).mkdir(parents=True)
    for i in range(neuron):
        (root / f"dev/neuron{i}").touch()
    if efa:
        (root / "dev/infiniband").mkdir()
        for i in range(efa):
            (root / f"dev/infiniband/uverbs{i}").touch()
    if driver is not None:
        (root / "sys/module/neuron/version").write_text(driver + "\n")


def _guards_pass(root: Path, env: dict[str, str], bin_dir: Path) -> bool:
    """What systemd does before starting ecs.service: every ExecStartPre of its drop-ins must succeed."""
    for drop_in in sorted((root / "etc/systemd/system/ecs.service.d").glob("*.conf")):
        for line in drop_in.read_text().splitlines():
            if line.startswith("ExecStartPre="):
                command = shlex.split(line.partition("=")[2])
                run = subprocess.run([str(bin_dir / Path(command[0]).name), *command[1:]], env=env, check=False)
                if run.returncode != 0:
                    return False
    return True


def boot(script: str, instance_type: str, tmp: Path, *, driver: str | None, **faults: str) -> Boot:
    """Run the user data on a fake `instance_type` host; assert the agent never starts without FSx."""
    # Safety on a machine where tests may run as root: every host path must be under the fake root.
    assert 'ROOT="${TRAINIUM_NODE_ROOT:-}"' in script
    root, bin_dir = tmp / "root", _bin(tmp)
    _host(root, instance_type, driver)
    (tmp / "script.sh").write_text(script)
    env = {"PATH": str(bin_dir), "TRAINIUM_NODE_ROOT": str(root), "BOOT_CALLS": str(tmp / "calls"),
           "BOOT_MOUNTS": str(tmp / "mounts"), "HOME": str(tmp), **faults}
    run = subprocess.run([shutil.which("bash"), str(tmp / "script.sh")], env=env, cwd=tmp, capture_output=True,
                         text=True, timeout=60, check=False)
    read = lambda name: (tmp / name).read_text() if (tmp / name).exists() else ""  # noqa: E731
    calls = read("calls").splitlines()
    shut_down = any(c.startswith("shutdown") for c in calls)
    result = Boot(exit_code=run.returncode, calls=calls, console=read("root/dev/console"),
                  mounts=read("mounts").splitlines(), root=root,
                  agent_starts=not shut_down and _guards_pass(root, env, bin_dir))
    assert not result.agent_starts or "/fsx" in result.mounts, f"agent starts with /fsx unmounted: {result}"
    return result


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
