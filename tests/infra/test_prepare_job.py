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


def _job(template, name: str) -> dict:
    (job,) = [r["Properties"] for k, r in template.find_resources("AWS::Batch::JobDefinition").items()
              if k.startswith(f"Jobs{name}JobDefinition")]
    return job


def test_prepare_runs_as_plan_array_children_and_finish(dev_templates):
    """The plan reads the upload; the array children and the finish only need the run dir and the
    array size (Batch sets AWS_BATCH_JOB_ARRAY_INDEX but not the size)."""
    plan = _job(dev_templates["compute"], "Prepare")["ContainerProperties"]["Command"]
    assert plan[:3] == ["prepare", "--phase", "plan"] and "Ref::data_uri" in plan
    for name, phase in (("PrepareShards", "shard"), ("PrepareFinish", "finish")):
        job = _job(dev_templates["compute"], name)
        assert job["ContainerProperties"]["Command"] == [
            "prepare", "--phase", phase, "--run-dir", "/fsx/runs/Ref::run_id", "--shard-count", "Ref::shard_count"]
        # "" drops the flag (entrypoint): a child without a count fails (exit 78), never guesses its slice.
        assert job["Parameters"] == {"shard_count": ""}
