"""The failure classifier function's code asset: exactly pipeline_steps.diagnosis (and the package
marker), runnable with the standard library alone, as the Lambda runtime will run it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from aws_cdk import App, Environment, Stack
from aws_cdk import aws_kms as kms
from aws_cdk import aws_logs as logs

from stacks.constructs.failure_diagnosis import HANDLER, FailureDiagnosis

EXPECTED = {"pipeline_steps/__init__.py", "pipeline_steps/diagnosis/__init__.py",
            "pipeline_steps/diagnosis/classifier.py", "pipeline_steps/diagnosis/handler.py",
            "pipeline_steps/diagnosis/job_logs.py", "pipeline_steps/diagnosis/rules.toml",
            "pipeline_steps/diagnosis/log_model.py", "pipeline_steps/diagnosis/log_model.json.gz",
            "pipeline_steps/diagnosis/prefilter.py"}


def test_the_function_ships_only_the_classifier_and_runs_on_the_standard_library(tmp_path: Path) -> None:
    app = App(outdir=str(tmp_path / "cdk.out"))
    stack = Stack(app, "Asset", env=Environment(account="123456789012", region="us-east-1"))
    FailureDiagnosis(stack, "Diagnosis", stage="dev", job_log_groups=[logs.LogGroup(stack, "JobLogs")],
                     key=kms.Key(stack, "Key"), log_retention_days=30)
    app.synth()
    (asset,) = [p for p in (tmp_path / "cdk.out").iterdir() if p.name.startswith("asset.")]
    shipped = {p.relative_to(asset).as_posix() for p in asset.rglob("*") if p.is_file()}
    assert shipped == EXPECTED
    # -S -I: no site-packages, no PYTHONPATH, only the asset on the path (Lambda's /var/task); the
    # handler module as Lambda imports it, on a failure outside any job (no AWS call), with the
    # rules read from the shipped package data.
    module, _, function = HANDLER.rpartition(".")
    code = (f"import sys; sys.path.insert(0, '.'); import json, {module} as h; assert callable(h.{function}); "
            "print(json.dumps(h.classify_failure({'run_id': 'r', 'failure': {'InvalidInput': {'Error': 'InvalidInput', "
            "'Cause': 'The execution input has problems, fix them: num_nodes'}}}, None, None)))")
    result = subprocess.run([sys.executable, "-S", "-I", "-c", code], cwd=asset, capture_output=True, text=True,
                            timeout=60, check=True)
    assert json.loads(result.stdout)["class"] == "bad_config"
    # and the log model, for what no rule names (a checkpoint that cannot be written; the corpus's
    # ronin-51 case)
    log = ("    super(_open_zipfile_writer_file, self).__init__(torch._C.PyTorchFileWriter(str(name)))",
           "RuntimeError: File my_out/checkpoints/checkpoint_0.pt cannot be opened.")
    code = ("import sys; sys.path.insert(0, '.'); from pipeline_steps.diagnosis import NodeLog, classify; "
            f"d = classify([NodeLog('main', {log!r})]); print(d.cls, d.decided_by)")
    result = subprocess.run([sys.executable, "-S", "-I", "-c", code], cwd=asset, capture_output=True, text=True,
                            timeout=60, check=True)
    assert result.stdout.split(maxsplit=1) == ["storage_error", "log model\n"]
