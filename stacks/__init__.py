"""CDK infrastructure: stage config, stacks (wiring) and constructs (resource families)."""
