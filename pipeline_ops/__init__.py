"""Operator tools for the training pipeline on AWS: the `trainium-runs` CLI (cli.py: arguments;
commands.py, rendering.py) over a run read from Step Functions, Batch and CloudWatch Logs
(context.py, run_reader.py, runs.py)."""
