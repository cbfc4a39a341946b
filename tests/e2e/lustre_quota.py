"""A stand-in for Lustre's `lfs` that enforces a project quota on a directory, for the teams run.

    lustre_quota.py project -d DIR                    prints "<project id> - DIR" (0: none yet)
    lustre_quota.py project -p ID -r -s DIR           DIR's files count toward project ID
    lustre_quota.py setquota -p ID -b 0 -B KIB ... MOUNT   project ID may use at most KIB

This machine's kernel has no quota support (CONFIG_QUOTA is off: ext4 refuses the prjquota mount
option), so a project's directory becomes a tmpfs of its hard limit: a write past it fails in the
kernel, for every process, as on Lustre -- with ENOSPC ("No space left on device") where Lustre
returns EDQUOT ("Disk quota exceeded"); the failure classifier files both under storage_error
(tests/steps/test_diagnosis.py checks the Lustre message). One directory per project (the teams'
layout); the directory must be empty when its quota is first set (a host's boot creates it).
State: the JSON file $LFS_STATE ({"projects": {dir: id}, "limits": {id: KiB}}).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

MOUNT = "/usr/bin/mount"  # absolute: the boot rehearsal's PATH holds a recording `mount` stand-in


def _state() -> tuple[Path, dict]:
    path = Path(os.environ["LFS_STATE"])
    return path, json.loads(path.read_text()) if path.exists() else {"projects": {}, "limits": {}}


def _mounted(directory: str) -> bool:
    return any(line.split()[1] == directory for line in Path("/proc/mounts").read_text().splitlines())


def _enforce(directory: str, kib: int) -> None:
    if _mounted(directory):
        subprocess.run([MOUNT, "-o", f"remount,size={kib}k", directory], check=True)
        return
    if any(Path(directory).iterdir()):
        raise SystemExit(f"lustre_quota: {directory} is not empty; the stand-in sets a quota on a new directory only")
    subprocess.run([MOUNT, "-t", "tmpfs", "-o", f"size={kib}k,mode=0755", "tmpfs", directory], check=True)


def main(argv: list[str]) -> int:
    path, state = _state()
    command, args = argv[0], argv[1:]
    if command == "project" and args[0] == "-d":
        directory = str(Path(args[-1]).resolve())
        print(f" {state['projects'].get(directory, 0)} - {directory}")
        return 0
    if command == "project" and args[0] == "-p":
        directory = str(Path(args[-1]).resolve())
        state["projects"][directory] = int(args[1])
    elif command == "setquota" and args[0] == "-p":
        state["limits"][args[1]] = int(args[args.index("-B") + 1])
    else:
        print(f"lustre_quota: unsupported: lfs {' '.join(argv)}", file=sys.stderr)
        return 2
    for directory, project in state["projects"].items():
        if str(project) in state["limits"]:
            _enforce(directory, state["limits"][str(project)])
    path.write_text(json.dumps(state))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
