"""Boot a host from a synthesized template: each launch template's user data (the MIME document EC2
receives) runs under bash against a fake root (device files, sysfs, /etc) with recording stand-ins
for the commands that change a host (dnf, mount, systemctl, shutdown, lfs, ...). After the script,
systemd starts the ECS agent unless the host shut down, and only if the agent unit's ExecStartPre
guards pass; every boot asserts that the agent never starts with /fsx unmounted. PATH holds only the
stand-ins and a few read-only tools, so nothing reaches this machine's host. Used by
tests/infra/test_node_boot.py and the teams end-to-end run (tests/e2e/test_teams.py).
"""

from __future__ import annotations

import base64
import email
import json
import shlex
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

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
  lfs) [ -z "${FAIL_LFS:-}" ] || exit 1
       if [ "$1 $2" = "project -d" ]; then echo " ${LFS_PROJECT:-0} - ${*: -1}"; fi ;;
  logger) cat > /dev/null ;;
esac
"""
STANDINS = ("dnf", "mount", "mountpoint", "modinfo", "logger", "systemctl", "shutdown", "sleep", "lfs")


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


def _bin(tmp: Path, tools: Mapping[str, str]) -> Path:
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    standin = bin_dir / "standin"
    standin.write_text(STANDIN)
    standin.chmod(0o755)
    for name in STANDINS:
        if name in tools:
            (bin_dir / name).write_text(tools[name])
            (bin_dir / name).chmod(0o755)
        else:
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


def boot(script: str, instance_type: str, tmp: Path, *, driver: str | None, tools: Mapping[str, str] = {},
         **faults: str) -> Boot:
    """Run the user data on a fake `instance_type` host whose root is tmp/root; assert the agent
    never starts without FSx. `tools`: a command's own script instead of the recording stand-in."""
    # Safety on a machine where tests may run as root: every host path must be under the fake root.
    assert 'ROOT="${TRAINIUM_NODE_ROOT:-}"' in script
    root, bin_dir = tmp / "root", _bin(tmp, tools)
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
