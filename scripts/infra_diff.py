#!/usr/bin/env python3
"""Readable diff between the committed template snapshots (tests/infra/snapshots/) and the
current synthesis of the same stages (dev and prod: fixed test account and training zone, registry
image; prod with the test-only AMI pin), per resource:

    python scripts/infra_diff.py                 # both stages; exit 1 when something changed
    python scripts/infra_diff.py --stage prod    # one stage
    python scripts/infra_diff.py --update        # rewrite the snapshots (same as `make snapshots`)

For a diff against a *deployed* stage use the CDK CLI: `npx cdk diff -c stage=prod`.
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "infra"))

from infra_synth import SNAPSHOT_STAGES, build, snapshot_path, template_json  # noqa: E402


def _lines(value: object) -> list[str]:
    return json.dumps(value, indent=1, sort_keys=True).splitlines()


def diff_template(name: str, old: dict, new: dict) -> list[str]:
    out: list[str] = []
    old_res, new_res = old.get("Resources", {}), new.get("Resources", {})
    for logical_id in sorted(set(old_res) | set(new_res)):
        before, after = old_res.get(logical_id), new_res.get(logical_id)
        if before == after:
            continue
        if before is None:
            out.append(f"[+] {after['Type']} {logical_id}")
        elif after is None:
            out.append(f"[-] {before['Type']} {logical_id}   (DELETED; check it is not stateful)")
        else:
            out.append(f"[~] {after['Type']} {logical_id}")
            out += ["    " + ln for ln in difflib.unified_diff(_lines(before), _lines(after), lineterm="", n=2)][2:]
    for section in ("Parameters", "Outputs", "Conditions", "Mappings"):
        if old.get(section) != new.get(section):
            out.append(f"[~] {section}")
            out += ["    " + ln for ln in difflib.unified_diff(_lines(old.get(section)), _lines(new.get(section)), lineterm="", n=2)][2:]
    return [f"Stack {name}", *out] if out else []


def diff_stage(stage: str, *, update: bool) -> bool:
    """Print the stage's differences (or rewrite its snapshots); True when something changed."""
    app, stacks = build(stage, nag=False)
    changed = False
    for stack in stacks.values():
        current = template_json(app, stack)
        path = snapshot_path(stack)
        if update:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(current, indent=1, sort_keys=True) + "\n")
            print(f"wrote {path}")
            continue
        old = json.loads(path.read_text()) if path.exists() else {}
        lines = diff_template(stack.stack_name, old, current)
        if lines:
            changed = True
            print("\n".join(lines) + "\n")
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--update", action="store_true", help="rewrite the snapshots with the current synthesis")
    parser.add_argument("--stage", choices=SNAPSHOT_STAGES, action="append",
                        help="only this stage (repeatable); default: all of " + ", ".join(SNAPSHOT_STAGES))
    args = parser.parse_args(argv)
    changed = False
    for stage in args.stage or SNAPSHOT_STAGES:
        changed |= diff_stage(stage, update=args.update)
    if not args.update and not changed:
        print("No differences between the snapshots and the current synthesis.")
    return 1 if changed else 0


if __name__ == "__main__":
    sys.exit(main())
