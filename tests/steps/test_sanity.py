"""sanity: passes on healthy local backends, catches a wrong collective value with exit 75,
reports Neuron-only checks as skipped (never passed) here, and judges Neuron host tools'
output correctly (fake neuron-ls / nccom-test / fi_info scripts on PATH)."""

from __future__ import annotations

import json
import stat
import textwrap
import time
from pathlib import Path

import pytest

from pipeline_steps import __main__ as cli
from pipeline_steps import contract, sanity
from pipeline_steps.errors import BadConfigError, ExitCode
from pipeline_steps.fileio import read_json

from .conftest import cli_env, run_cli

NEURON_ONLY = {"neuron_devices", "efa_devices", "efa_provider", "fsx_mount", "fsx_writable", "nccom_all_reduce"}
TORCH_CHECKS = {"world_size", "device_matmul", "all_reduce", "all_gather", "reduce_scatter"}
LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
              "AWS_BATCH_JOB_NUM_NODES", "NPROC_PER_NODE", "INSTANCE_TYPE", sanity.FAULT_RANK_ENV)


@pytest.fixture
def single_process(monkeypatch):
    """A plain `python -m pipeline_steps sanity` environment, whatever launched pytest."""
    for name in LAUNCH_ENV:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def checks_by_name(result: dict) -> dict[str, dict]:
    return {c["name"]: c for c in result["checks"]}


# ----------------------------------------------------------------------------- end to end

def test_passes_single_process_on_cpu_and_writes_sanity_json(single_process, tmp_path):
    code = cli.main(["sanity", "--run-dir", str(tmp_path), "--backend", "cpu", "--iterations", "2",
                     "--timeout-s", "120"])
    assert code == ExitCode.OK
    result = read_json(tmp_path / "sanity" / "sanity.json")
    assert result["status"] == "passed" and result["exit_code"] == 0
    assert result["world_size"] == 1 and result["failed_ranks"] == [] and result["fault_injection"] is None
    checks = checks_by_name(result)
    assert set(checks) == NEURON_ONLY | TORCH_CHECKS
    for check in checks.values():
        assert set(check) == {"name", "status", "expected", "actual", "seconds", "detail"}
        assert check["seconds"] >= 0
    assert all(checks[n]["status"] == "passed" for n in TORCH_CHECKS)
    # Not a Neuron host: skipped with a reason, never passed.
    assert all(checks[n]["status"] == "skipped" and checks[n]["detail"] for n in NEURON_ONLY)
    assert "neuron-ls not on PATH" in checks["neuron_devices"]["detail"]
    assert checks["world_size"]["expected"] == checks["world_size"]["actual"] == 1
    assert read_json(tmp_path / "sanity" / "rank-0.json")["status"] == "passed"


def test_passes_single_process_on_xla_cpu(tmp_path):
    result = run_cli("sanity", "--run-dir", tmp_path, "--backend", "xla", "--iterations", "2",
                     env=cli_env(PJRT_DEVICE="CPU"), timeout=300)
    assert result.returncode == 0, result.stderr
    summary = read_json(tmp_path / "sanity" / "sanity.json")
    assert summary["backend"] == "xla" and summary["status"] == "passed"
    assert "xla" in checks_by_name(summary)["device_matmul"]["detail"]


def test_passes_under_torchrun_with_gloo(tmp_path):
    result = run_cli("sanity", "--run-dir", tmp_path, "--backend", "cpu", "--iterations", "2",
                     "--expect-world-size", "2", torchrun=2, timeout=300)
    assert result.returncode == 0, result.stderr
    summary = read_json(tmp_path / "sanity" / "sanity.json")
    assert summary["status"] == "passed" and summary["world_size"] == 2 and summary["failed_ranks"] == []
    assert summary["expected_world_size_source"] == "--expect-world-size"
    rank1 = read_json(tmp_path / "sanity" / "rank-1.json")
    checks1 = checks_by_name(rank1)
    assert rank1["status"] == "passed" and rank1["world_size"] == 2
    assert all(checks1[n]["status"] == "passed" for n in TORCH_CHECKS)
    # Host checks run once per node, by local rank 0; the other ranks wait for them.
    assert all("local rank 0" in checks1[n]["detail"] for n in NEURON_ONLY)
    assert checks1["wait_host_checks"]["status"] == "passed"


def test_wrong_all_reduce_value_fails_with_exit_75_and_expected_vs_actual(single_process, tmp_path, caplog):
    single_process.setenv(sanity.FAULT_RANK_ENV, "0")
    code = cli.main(["sanity", "--run-dir", str(tmp_path), "--backend", "cpu", "--iterations", "1",
                     "--timeout-s", "120"])
    assert code == ExitCode.RETRYABLE == 75
    assert "all_reduce: expected x[0:4]=[1, 2, 3, 4], actual x[0:4]=[1001, 1002, 1003, 1004]" in caplog.text
    assert "FAULT INJECTION ACTIVE" in caplog.text
    summary = read_json(tmp_path / "sanity" / "sanity.json")
    assert summary["status"] == "failed" and summary["exit_code"] == 75 and summary["failed_ranks"] == [0]
    assert summary["fault_injection"] == {"env": sanity.FAULT_RANK_ENV, "rank": 0}
    failed = [c["name"] for c in summary["checks"] if c["status"] == "failed"]
    assert failed == ["all_reduce"]  # the other collectives were not affected


def test_one_faulty_rank_under_torchrun_fails_every_rank_with_75(tmp_path):
    result = run_cli("sanity", "--run-dir", tmp_path, "--backend", "cpu", "--iterations", "1",
                     env=cli_env(**{sanity.FAULT_RANK_ENV: "1"}), torchrun=2, timeout=300)
    # torchrun reports the worker's code and itself exits 1 (why the entrypoint records it: docs/infrastructure.md).
    assert result.returncode != 0
    assert "exitcode  : 75" in result.stderr
    assert "expected x[0:4]=[3, 6, 9, 12], actual x[0:4]=[1003, 1006, 1009, 1012]" in result.stderr
    summary = read_json(tmp_path / "sanity" / "sanity.json")
    assert summary["status"] == "failed" and summary["exit_code"] == 75
    assert summary["failed_ranks"] == [0, 1]
    assert [c["name"] for c in summary["failures_by_rank"]["1"]] == ["all_reduce"]


def test_fault_switch_is_inert_by_default_and_rejects_garbage():
    assert sanity.fault_rank({}) is None
    assert sanity.fault_rank({sanity.FAULT_RANK_ENV: ""}) is None
    assert sanity.fault_rank({sanity.FAULT_RANK_ENV: "3"}) == 3
    with pytest.raises(BadConfigError, match=sanity.FAULT_RANK_ENV):
        sanity.fault_rank({sanity.FAULT_RANK_ENV: "one"})


# ----------------------------------------------------------------------------- closed forms and parsing

@pytest.mark.parametrize("world_size", [1, 2, 6, 7, 8, 13, 32, 64, 2048])
def test_rank_weight_sum_closed_form(world_size):
    assert sanity.sum_rank_weights(world_size) == sum(sanity.rank_weight(r) for r in range(world_size))
    # Every all_reduce element stays an exact fp32 integer even at 2048 ranks.
    assert sanity.sum_rank_weights(world_size) * 13 < 2**24


def test_expected_world_size_precedence():
    batch = {"AWS_BATCH_JOB_NUM_NODES": "4", "NPROC_PER_NODE": "32", "WORLD_SIZE": "64"}
    assert sanity.expected_world_size(8, batch) == (8, "--expect-world-size")
    assert sanity.expected_world_size(None, batch)[0] == 128  # Batch's intent beats what torchrun got
    assert sanity.expected_world_size(None, {"WORLD_SIZE": "2"}) == (2, "WORLD_SIZE (torchrun)")
    assert sanity.expected_world_size(None, {})[0] == 1


def test_sanity_judges_hosts_by_the_shared_instance_table():
    assert sanity.INSTANCE_TYPES is contract.INSTANCE_TYPES
    counts = {name: (s.neuron_devices, s.neuron_cores, s.efa_interfaces) for name, s in sanity.INSTANCE_TYPES.items()}
    assert counts == {"trn1.32xlarge": (16, 32, 8), "trn1n.32xlarge": (16, 32, 16), "trn1.2xlarge": (1, 2, 0)}


def test_expected_instance_type_comes_from_the_flag_or_the_job_environment():
    assert sanity.expected_instance_type(None, {}) is None
    assert sanity.expected_instance_type(None, {"INSTANCE_TYPE": "trn1n.32xlarge"}) == "trn1n.32xlarge"
    assert sanity.expected_instance_type("trn1.2xlarge", {"INSTANCE_TYPE": "trn1n.32xlarge"}) == "trn1.2xlarge"
    with pytest.raises(BadConfigError, match="p4d.24xlarge.*not in the instance table"):
        sanity.expected_instance_type(None, {"INSTANCE_TYPE": "p4d.24xlarge"})


def test_mount_of_picks_the_longest_mount_point():
    mounts = textwrap.dedent("""\
        overlay / overlay rw,relatime 0 0
        fs-0123.fsx.us-east-1.amazonaws.com@tcp:/abcdefgh /fsx lustre rw,noatime,flock 0 0
        tmpfs /fsx\\040scratch tmpfs rw 0 0
    """)
    assert sanity.mount_of("/fsx/runs/r1", mounts) == ("/fsx", "lustre")
    assert sanity.mount_of("/fsx", mounts) == ("/fsx", "lustre")
    assert sanity.mount_of("/fsxother", mounts) == ("/", "overlay")
    assert sanity.mount_of("/fsx scratch/x", mounts) == ("/fsx scratch", "tmpfs")


NCCOM_OK = """\
       size(B)    count(elems)    type    time(us)    algbw(GB/s)    busbw(GB/s)
      33554432         8388608    fp32         768          40.69          40.69
Avg bus bandwidth:      40.6901GB/s
"""
NCCOM_BROKEN = """\
     size(B)    count(elems)    type    time(us)    algbw(GB/s)    busbw(GB/s)
    33554432    Failure running neuron-bench - log file /tmp/nccom_test_log_7pqpdfjf.log
1 errors found - test failed
"""


def test_parse_nccom_output():
    ok = sanity.parse_nccom_output(NCCOM_OK)
    assert ok["rows"][0]["busbw"] == 40.69 and ok["avg_busbw"] == pytest.approx(40.6901) and not ok["errors"]
    broken = sanity.parse_nccom_output(NCCOM_BROKEN)
    assert broken["rows"] == [] and broken["errors"]


# ----------------------------------------------------------------------------- host checks with fake tools

def fake_tool(bin_dir: Path, name: str, stdout: str, exit_code: int = 0) -> None:
    (bin_dir / f"{name}.out").write_text(stdout)
    script = bin_dir / name
    script.write_text(f"#!/bin/sh\ncat '{bin_dir / (name + '.out')}'\nexit {exit_code}\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)


def neuron_ls_json(devices: int, cores_each: int = 2) -> str:
    return json.dumps([{"neuron_device": i, "bdf": f"00:{i:02x}.0", "connected_to": None, "nc_count": cores_each,
                        "memory_size": 34359738368, "neuroncore_ids": [2 * i, 2 * i + 1], "neuron_processes": []}
                       for i in range(devices)])


@pytest.fixture
def fake_host(tmp_path, monkeypatch):
    """A PATH holding only fake Neuron/libfabric tools, a fake /dev/infiniband and an empty fake /dev."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    infiniband = tmp_path / "infiniband"
    infiniband.mkdir()
    dev = tmp_path / "dev"
    dev.mkdir()
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    monkeypatch.setattr(sanity, "INFINIBAND_DIR", infiniband)
    monkeypatch.setattr(sanity, "NEURON_DEV_DIR", dev)
    return bin_dir, infiniband


def run_host_checks(instance_type: str | None, *, fsx_path: str | None = None,
                    floor: float | None = None) -> dict[str, sanity.Check]:
    report = sanity.Report(rank=0, local_rank=0, world_size=1, backend="cpu")
    spec = contract.INSTANCE_TYPES[instance_type] if instance_type else None
    sanity.HostChecks(report, spec, instance_type, fsx_path, floor, iterations=1,
                      deadline=time.monotonic() + 60).run_all()
    return {c.name: c for c in report.checks}


def test_healthy_trn1_32xlarge_host_passes(fake_host):
    bin_dir, infiniband = fake_host
    fake_tool(bin_dir, "neuron-ls", neuron_ls_json(16))
    fake_tool(bin_dir, "fi_info", "provider: efa\n    fabric: efa\nprovider: efa\n")
    fake_tool(bin_dir, "nccom-test", NCCOM_OK)
    for i in range(8):
        (infiniband / f"uverbs{i}").touch()
    checks = run_host_checks("trn1.32xlarge", floor=30.0)
    for name in ("neuron_devices", "efa_devices", "efa_provider", "nccom_all_reduce"):
        assert checks[name].status == "passed", checks[name]
    assert checks["neuron_devices"].actual == {"devices": 16, "cores": 32}
    assert checks["fsx_mount"].status == checks["fsx_writable"].status == "skipped"


def test_unhealthy_host_reports_expected_vs_actual(fake_host, tmp_path):
    bin_dir, infiniband = fake_host
    fake_tool(bin_dir, "neuron-ls", neuron_ls_json(15))  # one device lost
    fake_tool(bin_dir, "fi_info", "fi_getinfo: -61 (No data available)\n", exit_code=1)
    fake_tool(bin_dir, "nccom-test", NCCOM_OK)
    for i in range(7):  # one uverbs device not mapped
        (infiniband / f"uverbs{i}").touch()
    checks = run_host_checks("trn1n.32xlarge", fsx_path=str(tmp_path), floor=50.0)
    assert checks["neuron_devices"].status == "failed"
    assert (checks["neuron_devices"].expected, checks["neuron_devices"].actual) == (
        {"devices": 16, "cores": 32}, {"devices": 15, "cores": 30})
    assert (checks["efa_devices"].status, checks["efa_devices"].expected, checks["efa_devices"].actual) == (
        "failed", 16, 7)
    assert checks["efa_provider"].status == "failed"
    assert checks["nccom_all_reduce"].status == "failed" and "50" in checks["nccom_all_reduce"].expected
    # tmp_path exists and is writable, but it is not FSx for Lustre.
    assert checks["fsx_mount"].status == "failed" and checks["fsx_mount"].expected.startswith("lustre")
    assert checks["fsx_writable"].status == "passed"
    assert not list(tmp_path.glob(".sanity-probe-*"))  # the probe file is cleaned up


def test_broken_nccom_and_trn1_2xlarge_without_efa(fake_host):
    bin_dir, _ = fake_host
    fake_tool(bin_dir, "neuron-ls", neuron_ls_json(1))
    fake_tool(bin_dir, "nccom-test", NCCOM_BROKEN, exit_code=1)
    checks = run_host_checks("trn1.2xlarge")
    assert checks["neuron_devices"].status == "passed"
    assert checks["efa_devices"].status == "passed" and checks["efa_devices"].actual == 0
    assert checks["efa_provider"].status == "skipped" and "no EFA" in checks["efa_provider"].detail
    assert checks["nccom_all_reduce"].status == "failed" and "errors found" in checks["nccom_all_reduce"].detail


def test_without_neuron_ls_the_expected_devices_are_counted_in_dev(fake_host, tmp_path):
    """The job definition maps /dev/neuron0..N-1 into the container: with an instance type to
    check against, a host without neuron-ls is judged by those device files, never skipped."""
    for i in range(15):
        (tmp_path / "dev" / f"neuron{i}").touch()
    check = run_host_checks("trn1.32xlarge")["neuron_devices"]
    assert (check.status, check.expected, check.actual) == ("failed", {"devices": 16}, {"devices": 15})
    assert "missing Neuron devices" in check.detail
    (tmp_path / "dev" / "neuron15").touch()
    assert run_host_checks("trn1.32xlarge")["neuron_devices"].status == "passed"
    assert run_host_checks(None)["neuron_devices"].status == "skipped"  # no instance type: nothing to expect


@pytest.mark.skipif(Path("/dev/neuron0").exists() or Path("/dev/infiniband").exists(),
                    reason="this host has Neuron or EFA devices")
def test_instance_type_from_the_environment_fails_75_naming_the_missing_devices(tmp_path):
    """What the sanity job does on a host that is not the trn1.32xlarge it was promised."""
    result = run_cli("sanity", "--run-dir", tmp_path, "--backend", "cpu", "--iterations", "1", "--timeout-s", "120",
                     env=cli_env(INSTANCE_TYPE="trn1.32xlarge"))
    assert result.returncode == ExitCode.RETRYABLE == 75, result.stderr[-3000:]
    assert "neuron_devices: expected {'devices': 16}, actual {'devices': 0}" in result.stderr
    assert "efa_devices: expected 8, actual 0" in result.stderr and "missing EFA devices" in result.stderr
    summary = read_json(tmp_path / "sanity" / "sanity.json")
    assert summary["instance_type"] == "trn1.32xlarge" and summary["exit_code"] == 75
    assert {c["name"] for c in summary["checks"] if c["status"] == "failed"} == {"neuron_devices", "efa_devices"}


def test_an_instance_type_outside_the_table_is_a_config_error(tmp_path):
    result = run_cli("sanity", "--run-dir", tmp_path, "--backend", "cpu", env=cli_env(INSTANCE_TYPE="p4d.24xlarge"))
    assert result.returncode == ExitCode.BAD_CONFIG, result.stderr[-3000:]
    assert "not in the instance table" in result.stderr


def test_nccom_test_bootstraps_on_its_own_node_not_the_main_node(fake_host, tmp_path, monkeypatch):
    """Every node runs a one-node nccom-test; the entrypoint exports the main node's address for
    training, which the test must not inherit (all nodes' tests would meet at the main node)."""
    bin_dir, _ = fake_host
    seen = tmp_path / "root-comm-id"
    (bin_dir / "nccom-test.out").write_text(NCCOM_OK)
    script = bin_dir / "nccom-test"
    script.write_text(f"#!/bin/sh\necho \"$NEURON_RT_ROOT_COMM_ID\" > '{seen}'\ncat '{bin_dir / 'nccom-test.out'}'\n")
    script.chmod(0o755)
    monkeypatch.setenv("NEURON_RT_ROOT_COMM_ID", "10.42.0.5:46820")  # the main node's, from the entrypoint
    checks = run_host_checks("trn1.2xlarge")
    assert checks["nccom_all_reduce"].status == "passed", checks["nccom_all_reduce"]
    host, port = seen.read_text().strip().split(":")
    assert host == "127.0.0.1" and int(port) > 0
