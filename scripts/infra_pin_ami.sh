#!/usr/bin/env bash
# Pin the current ECS-optimized AL2023 Neuron AMI of each region given into stacks/neuron_amis.json
# ({"<region>": {"image_id", "image_name", "pinned_at"}}), the file stacks/config.py reads. Synth
# never looks AMIs up; this script is the only thing that does (needs AWS credentials).
#     scripts/infra_pin_ami.sh us-east-1 [us-west-2 ...]
#     git diff stacks/neuron_amis.json && make test && git commit -m "Pin Neuron AMI" stacks/neuron_amis.json tests/infra/snapshots
# An AMI built before the Neuron driver of the training image's SDK release shipped
# (pipeline_steps/contract.py NEURON_SDK) is refused: it carries an older driver, and the launch
# template's user data would refuse such hosts at boot, so jobs would only wait RUNNABLE.
# NEURON_AMIS_FILE overrides the output path (tests).
set -euo pipefail
readonly PARAM=/aws/service/ecs/optimized-ami/amazon-linux-2023/neuron/recommended
repo="$(cd "$(dirname "$0")/.." && pwd)"
out="${NEURON_AMIS_FILE:-$repo/stacks/neuron_amis.json}"
[ "$#" -ge 1 ] || { echo "usage: $0 REGION [REGION...]" >&2; exit 2; }
python_bin="$(command -v python3 || command -v python)"

for region in "$@"; do
  # The parameter's value is JSON: {"image_id": ..., "image_name": ..., "ecs_agent_version": ..., ...}
  value="$(aws ssm get-parameter --region "$region" --name "$PARAM" --query Parameter.Value --output text)"
  REGION="$region" VALUE="$value" OUT="$out" REPO="$repo" "$python_bin" - <<'PY'
import datetime, json, os, re, sys
sys.path.insert(0, os.environ["REPO"])
from pipeline_steps.contract import ami_driver_problem
region, out = os.environ["REGION"], os.environ["OUT"]
value = json.loads(os.environ["VALUE"])
image_id, image_name = value.get("image_id", ""), value.get("image_name", "")
if not re.match(r"^ami-[0-9a-f]{8}([0-9a-f]{9})?$", image_id) or not image_name:
    sys.exit(f"unexpected SSM value for {region}: {value!r}")
if ami_driver_problem(image_name):
    sys.exit(f"{region}: {ami_driver_problem(image_name)}")
try:
    with open(out) as fh:
        pins = json.load(fh)
except FileNotFoundError:
    pins = {}
pins[region] = {"image_id": image_id, "image_name": image_name,
                "pinned_at": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")}
with open(out + ".tmp", "w") as fh:
    json.dump(dict(sorted(pins.items())), fh, indent=2, sort_keys=True)
    fh.write("\n")
os.replace(out + ".tmp", out)
print(f"{region}: {image_id} ({image_name}) -> {out}")
PY
done
