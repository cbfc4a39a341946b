"""Every way the local end-to-end run differs from AWS Batch on Trainium, with its reason: the one list.

The local Batch (local_batch.py) applies the argument and environment entries from here and nowhere
else, `python -m tests.e2e` prints them all, and test_e2e.py fails when a production job definition
carries a flag or variable that no scenario ran as the definition gives it, unless an entry here
says why it cannot run on this machine (`never_runs_here`).

A job of one process runs `--backend xla` as it is: the one-node scenario runs the Compile and Train
jobs' production commands (XLA, the stage's precision, NEURON_CC_FLAGS) on PJRT CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

DROPPED = "dropped"


@dataclass(frozen=True)
class Substitution:
    what: str
    """The flag, variable, tool or setting, as the job definition or the stage names it."""
    instead: str
    """What runs here."""
    reason: str
    commands: tuple[str, ...] = ()
    """The step commands (`sanity`, `train`, ...) it applies to; () = every job."""
    multi_process_only: bool = False
    """Applies only to jobs of more than one process (nodes x processes per node)."""

    def applies(self, command: str, processes: int) -> bool:
        return (not self.commands or command in self.commands) and (processes > 1 or not self.multi_process_only)

    @property
    def never_runs_here(self) -> bool:
        """No scenario can run it as given (a one-process job would otherwise)."""
        return not self.multi_process_only


FSX_MOUNT = Substitution(
    "/fsx", "WORK_DIR/fsx in every argument under /fsx",
    "no FSx for Lustre here (and no bind mount without root): the same files at another path; the data "
    "repository association's auto-import is a copy of the data bucket's incoming/ objects before each job")
XLA_ACROSS_PROCESSES = Substitution(
    "--backend xla", "--backend cpu (DDP over gloo)",
    "torch-xla's CPU client cannot run collectives across processes (pytorch/xla#5005); gloo stands in "
    "for the Neuron collectives. One-process jobs keep --backend xla", multi_process_only=True)
FSX_PATH_CHECK = Substitution(
    "--fsx-path", DROPPED, "sanity checks that the path is a Lustre mount", commands=("sanity",))
SANITY_INSTANCE_TYPE = Substitution(
    "INSTANCE_TYPE", "unset",
    "sanity checks the host against the instance type's Neuron devices and EFA interfaces", commands=("sanity",))
PROCESSES_PER_NODE = Substitution(
    "NPROC_PER_NODE", "1 (python -m tests.e2e --nproc-per-node)",
    "2 shared cores, not 32 NeuronCores: one process per node")
MLFLOW_SERVER = Substitution(
    "MLFLOW_TRACKING_URI", "not set",
    "the e2e runs the dev stage, which has no managed MLflow server (runs log to DIR/mlruns); prod's is a "
    "SageMaker MLflow ARN that moto does not serve")

SUBSTITUTIONS: tuple[Substitution, ...] = (
    FSX_MOUNT,
    XLA_ACROSS_PROCESSES,
    FSX_PATH_CHECK,
    SANITY_INSTANCE_TYPE,
    PROCESSES_PER_NODE,
    MLFLOW_SERVER,
    Substitution("Trainium (torch-neuronx)", "PJRT CPU for --backend xla; cpu for a step without --backend",
                 "no Neuron devices: pipeline_steps.distributed picks PJRT's CPU client when torch-neuronx is absent, "
                 "and default_backend() is cpu (xla on a Trainium host)"),
    Substitution("neuron_parallel_compile, neuron-ls, fi_info, nccom-test", "recording stand-ins (standin.py)",
                 "the Neuron and libfabric tools exist only in the image on a Trainium host; the stand-ins record "
                 "their arguments and environment and print a healthy host's answers"),
    Substitution("TrainingConfig.preset (stage config)", "tiny",
                 "the job definitions are synthesized for the dev stage with the tiny preset: minutes on 2 cores"),
    Substitution("AWS APIs", "a moto server (AWS_ENDPOINT_URL, test credentials)",
                 "no AWS account; the synthesized state machines, rule and job definitions run in moto"),
    Substitution("each node's own host", "process trees on this host: AWS_BATCH_JOB_MAIN_NODE_PRIVATE_IPV4_ADDRESS "
                 "127.0.0.1, one rendezvous port at a time",
                 "every node is a local process tree; Batch gives each node its own network interface"),
    Substitution("the image's environment", "PATH (this venv, stand-ins first), PYTHONPATH, TMPDIR, OMP_NUM_THREADS=1, "
                 "XLA_FLAGS=--xla_backend_optimization_level=0",
                 "the repository's code and this interpreter instead of the image; no thread oversubscription "
                 "on 2 shared cores; XLA's CPU backend compiles the same graphs through LLVM at -O0, in half "
                 "the time (Trainium compiles them with neuronx-cc)"),
)


def never_runs_here(command: str, name: str) -> Substitution | None:
    """The entry that keeps `name` (a flag or variable) of a `command` job from ever running here."""
    return next((s for s in SUBSTITUTIONS if s.what == name and s.never_runs_here and s.applies(command, 1)), None)
