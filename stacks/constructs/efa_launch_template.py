"""EC2 launch template for Trainium Batch nodes, generated from the instance table: EFA network
interfaces, an encrypted gp3 root volume, IMDSv2, and user data that
refuses a host with an old Neuron driver or wrong Neuron/EFA device counts and mounts FSx.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from aws_cdk import aws_ec2 as ec2
from constructs import Construct

from pipeline_steps.contract import FSX_MOUNT_POINT
from stacks.config import InstanceSpec

_USER_DATA = r"""set -euo pipefail
# Every path is under $ROOT: empty on a host. tests/infra/test_node_boot.py runs this script, taken
# from the synthesized template, against a fake root with recording stand-ins for the commands.
ROOT="${{TRAINIUM_NODE_ROOT:-}}"
exec > >(tee -a "$ROOT/var/log/trainium-node-init.log" | logger -t trainium-node-init) 2>&1

EXPECTED_EFA={efa}
EXPECTED_NEURON={neuron}
MIN_DRIVER={min_driver}
FSX_DNS="{fsx_dns}"
FSX_MOUNT_NAME="{fsx_mount_name}"
FSX="{mount_point}"

fail() {{
  # Out of service, saying why: the reason goes to the console (`aws ec2 get-console-output`), the
  # ECS agent is stopped (the guard below keeps it from starting anyway), and the host shuts down,
  # which terminates it (InstanceInitiatedShutdownBehavior=terminate); Batch launches a replacement.
  trap - ERR EXIT
  echo "trainium-node-init FATAL: $*" | tee -a "$ROOT/dev/console"
  systemctl stop --no-block ecs || true
  shutdown -h now
  exit 1
}}
# A failing command, or any other way out before the end, takes the host out of service.
trap 'fail "line $LINENO: $BASH_COMMAND (exit $?)"' ERR
trap 'fail "boot script ended before $FSX was mounted (exit $?)"' EXIT

# First, before anything can fail: systemd starts the ECS agent after cloud-init's user data,
# whatever its outcome, so the agent's unit itself requires FSx mounted (this boot, and every
# reboot, when the fstab entry below mounts it).
mkdir -p "$ROOT/etc/systemd/system/ecs.service.d"
printf '[Unit]\nRequiresMountsFor=%s\n[Service]\nExecStartPre=/usr/bin/mountpoint -q %s\n' "$FSX" "$FSX" \
  > "$ROOT/etc/systemd/system/ecs.service.d/10-require-fsx.conf"
systemctl daemon-reload

# Neuron driver: the DLC's Neuron runtime does not work with older host drivers.
driver="$(cat "$ROOT/sys/module/neuron/version" 2>/dev/null || modinfo -F version neuron 2>/dev/null || echo 0)"
lowest="$(printf '%s\n%s\n' "$MIN_DRIVER" "$driver" | sort -V | head -n1)"
[ "$lowest" = "$MIN_DRIVER" ] || fail "Neuron driver $driver < $MIN_DRIVER; pin a newer Neuron ECS AMI"

# Devices the job definitions map into containers: must match the instance table. Globs, not
# find: a host without EFA (trn1.2xlarge) has no /dev/infiniband at all.
shopt -s nullglob
neuron=("$ROOT"/dev/neuron[0-9]*)
efa=("$ROOT"/dev/infiniband/uverbs[0-9]*)
[ "${{#neuron[@]}}" -eq "$EXPECTED_NEURON" ] || fail "found ${{#neuron[@]}} /dev/neuron*, expected $EXPECTED_NEURON"
[ "${{#efa[@]}}" -eq "$EXPECTED_EFA" ] || fail "found ${{#efa[@]}} EFA devices (uverbs), expected $EXPECTED_EFA"

# FSx for Lustre (AL2023 lustre-client is 2.15, matching the file system version).
for attempt in 1 2 3 4 5; do
  dnf install -y lustre-client && break
  [ "$attempt" -lt 5 ] || fail "dnf install lustre-client failed 5 times"
  sleep $((attempt * 10))
done
mkdir -p "$ROOT$FSX"
for attempt in $(seq 1 10); do
  mount -t lustre -o noatime,flock "$FSX_DNS@tcp:/$FSX_MOUNT_NAME" "$ROOT$FSX" && break
  [ "$attempt" -lt 10 ] || fail "mount of $FSX_DNS@tcp:/$FSX_MOUNT_NAME failed 10 times"
  sleep $((attempt * 15))
done
mountpoint -q "$ROOT$FSX" || fail "$FSX is not a mount point"
echo "$FSX_DNS@tcp:/$FSX_MOUNT_NAME $FSX lustre defaults,noatime,flock,_netdev 0 0" >> "$ROOT/etc/fstab"
{quotas}trap - ERR EXIT
echo "trainium-node-init ok: driver $driver, ${{#neuron[@]}} neuron, ${{#efa[@]}} efa, $FSX mounted"
"""


# Team quotas: Lustre project quotas, set with lfs as root on the host, which the containers are
# not (`lfs setquota` needs CAP_SYS_ADMIN; docs/operations.md, "Teams"). Idempotent, on every boot:
# a changed quota reaches the file system with the next host. `lfs project -d` prints "<id> <flags>
# <dir>"; only a directory not yet in its project is tagged recursively (-r: existing files too; -s:
# new files inherit it). https://docs.aws.amazon.com/fsx/latest/LustreGuide/lustre-quotas.html
_QUOTA_FUNCTION = r"""project_quota() {  # <project id> <hard limit KiB> <directory>
  local dir="$ROOT$3" current
  mkdir -p "$dir"
  read -r current _ < <(lfs project -d "$dir") || current=""
  [ "$current" = "$1" ] || lfs project -p "$1" -r -s "$dir" || fail "lfs project -p $1 -r -s $3 failed"
  lfs setquota -p "$1" -b 0 -B "$2" -i 0 -I 0 "$ROOT$FSX" || fail "lfs setquota -p $1 (the quota of $3) failed"
  echo "trainium-node-init quota: project $1 = $3, hard limit $2 KiB (lfs quota -p $1 $FSX)"
}
"""


@dataclass(frozen=True)
class ProjectQuota:
    """A Lustre project quota the boot script applies: the project id, its hard block limit (KiB),
    and the directory (an absolute path under the FSx mount) whose files count toward it."""

    project_id: int
    limit_kib: int
    directory: str


def network_interfaces(spec: InstanceSpec, security_group_id: str) -> list[dict[str, object]]:
    """LaunchTemplateData.NetworkInterfaces for `spec`: card 0 / DeviceIndex 0, cards 1..N-1 /
    DeviceIndex 1, all `efa`, the EFA security group on every interface
    (https://awsdocs-neuron.readthedocs-hosted.com/en/latest/frameworks/torch/torch-neuronx/setup-trn1-multi-node-execution.html).
    No subnet: Batch launches into the compute environment's subnet, the one training subnet
    (https://docs.aws.amazon.com/batch/latest/userguide/launch-templates.html). Empty without EFA
    (trn1.2xlarge): that compute environment then carries the security group itself."""
    return [
        {
            "NetworkCardIndex": card,
            "DeviceIndex": 0 if card == 0 else 1,
            "InterfaceType": "efa",
            "Groups": [security_group_id],
            "DeleteOnTermination": True,
        }
        for card in range(spec.efa_interfaces)
    ]


def node_boot_script(spec: InstanceSpec, *, min_driver: str, fsx_dns_name: str, fsx_mount_name: str,
                     quotas: Sequence[ProjectQuota] = ()) -> str:
    """The boot checks + FSx mount + the teams' project quotas (bash, without the shebang
    UserData.for_linux adds). cloud-init runs it before systemd starts the ECS agent; the agent's
    unit is made to require the mount and a host that fails a check (or cannot set a quota) shuts
    down, so no job lands on a host without FSx."""
    applied = "".join(f"project_quota {q.project_id} {q.limit_kib} {q.directory}\n" for q in quotas)
    return _USER_DATA.format(
        quotas=_QUOTA_FUNCTION + applied if quotas else "",
        efa=spec.efa_interfaces,
        neuron=spec.neuron_devices,
        min_driver=min_driver,
        fsx_dns=fsx_dns_name,
        fsx_mount_name=fsx_mount_name,
        mount_point=FSX_MOUNT_POINT,
    )


def node_user_data(spec: InstanceSpec, *, min_driver: str, fsx_dns_name: str, fsx_mount_name: str,
                   quotas: Sequence[ProjectQuota] = ()) -> ec2.MultipartUserData:
    """The boot script as a MIME multi-part document, which Batch requires of launch-template user
    data (https://docs.aws.amazon.com/batch/latest/userguide/launch-templates.html)."""
    shell = ec2.UserData.for_linux()
    shell.add_commands(
        node_boot_script(spec, min_driver=min_driver, fsx_dns_name=fsx_dns_name, fsx_mount_name=fsx_mount_name,
                         quotas=quotas)
    )
    multipart = ec2.MultipartUserData()
    multipart.add_user_data_part(shell, ec2.MultipartBody.SHELL_SCRIPT, True)
    return multipart


class EfaLaunchTemplate(Construct):
    """Public attributes: launch_template (ec2.LaunchTemplate), spec, interfaces (the rendered list)."""

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        spec: InstanceSpec,
        security_group: ec2.ISecurityGroup,
        root_volume_gib: int,
        root_volume_throughput_mibps: int,
        root_volume_iops: int,
        min_driver: str,
        fsx_dns_name: str,
        fsx_mount_name: str,
        quotas: Sequence[ProjectQuota] = (),
    ) -> None:
        super().__init__(scope, construct_id)
        self.spec = spec
        self.launch_template = ec2.LaunchTemplate(
            self,
            "LaunchTemplate",
            # Hop limit 1: containers get credentials from the ECS task-role endpoint, never from
            # the instance role.
            require_imdsv2=True,
            http_put_response_hop_limit=1,
            # A host that fails a boot check shuts down; terminate removes it instead of leaving it stopped.
            instance_initiated_shutdown_behavior=ec2.InstanceInitiatedShutdownBehavior.TERMINATE,
            # gp3 with provisioned throughput/IOPS: the image pull onto it is on every node's startup path.
            block_devices=[
                ec2.BlockDevice(
                    device_name="/dev/xvda",  # root device of the AL2023 ECS AMIs
                    volume=ec2.BlockDeviceVolume.ebs(
                        root_volume_gib, volume_type=ec2.EbsDeviceVolumeType.GP3, encrypted=True, delete_on_termination=True,
                        iops=root_volume_iops, throughput=root_volume_throughput_mibps,
                    ),
                )
            ],
            user_data=node_user_data(
                spec, min_driver=min_driver, fsx_dns_name=fsx_dns_name, fsx_mount_name=fsx_mount_name, quotas=quotas
            ),
            version_description=f"{spec.name}: {spec.efa_interfaces} EFA, {spec.neuron_devices} Neuron devices",
        )
        self.interfaces = network_interfaces(spec, security_group.security_group_id)
        if self.interfaces:
            # The L2 has no network-interface property: L1 escape hatch. The security group goes on
            # the interfaces only; a top-level SecurityGroupIds would make EC2 reject the template.
            cfn = self.launch_template.node.default_child
            assert isinstance(cfn, ec2.CfnLaunchTemplate)
            cfn.add_property_override("LaunchTemplateData.NetworkInterfaces", self.interfaces)
