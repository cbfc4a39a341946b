"""Why a job failed: classify a failed job from its logs into a documented taxonomy.

`classify(logs, exit_code=..., status_reason=...)` returns a `Diagnosis`: the class, whether a retry
can help, the evidence lines (node and line number), a suggestion and a documentation link. The
rules are data (rules.toml, reviewed like code); what no rule names, a log model fit on the corpus
decides when it is confident (log_model.py). This package imports neither AWS nor torch, and is
what the pipeline's classifier Lambda function ships (handler.py). docs/operations.md has the
taxonomy and how to add a rule.
"""

from .classifier import STATUS_REASON, UNKNOWN, Diagnosis, Evidence, NodeLog, Rules, classify, load_rules

__all__ = ["STATUS_REASON", "UNKNOWN", "Diagnosis", "Evidence", "NodeLog", "Rules", "classify", "load_rules"]
