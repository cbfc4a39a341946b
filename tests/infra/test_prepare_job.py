"""The prepare job definition: it waits for the upload that FSx for Lustre is still importing."""

from __future__ import annotations


def _prepare_job(template) -> dict:
    jobs = [r["Properties"] for k, r in template.find_resources("AWS::Batch::JobDefinition").items()
            if k.startswith("JobsPrepareJobDefinition")]
    assert len(jobs) == 1
    return jobs[0]


def test_prepare_waits_for_the_upload_within_its_attempt_timeout(dev_templates):
    job = _prepare_job(dev_templates["compute"])
    command = job["ContainerProperties"]["Command"]
    wait_s = float(command[command.index("--upload-timeout") + 1])
    # Long enough for an asynchronous import, short enough to leave the attempt time for the work.
    assert 600 <= wait_s <= job["Timeout"]["AttemptDurationSeconds"] / 4
