#!/usr/bin/env bash
# Print the current ECS-optimized AL2023 Neuron AMI id for each region given (default us-east-1),
# to pin in stacks/config.py (_NEURON_AMIS). Needs AWS credentials; synth never calls this.
#     scripts/infra_pin_ami.sh us-east-1 us-west-2
set -euo pipefail
readonly PARAM=/aws/service/ecs/optimized-ami/amazon-linux-2023/neuron/recommended/image_id
for region in "${@:-us-east-1}"; do
  ami="$(aws ssm get-parameter --region "$region" --name "$PARAM" --query Parameter.Value --output text)"
  echo "\"$region\": \"$ami\","
done
