"""Operator tools for the training pipeline on AWS: the `trainium-runs` CLI (cli.py) over the
Step Functions / Batch / CloudWatch Logs view of a run (runs.py)."""
