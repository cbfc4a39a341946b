"""Process settings for the test suite on a 2-core machine: tests/conftest.py sets them for every
test process (and so for the commands the tests start), tests/e2e/local_batch.py passes them to
every job it runs.

- OMP_NUM_THREADS=1: the workers run side by side, one per core; torch's default of one intra-op
  thread per core would make them fight over the cores.
- XLA_FLAGS: XLA's CPU backend compiles each graph through LLVM; at optimisation level 0 the tiny
  preset's graphs compile in about half the time (compile step: 12.9 s -> 5.7 s). The traced
  graphs (HLO), which the tests check, are the same; on Trainium neuronx-cc compiles them, never LLVM.
"""

from __future__ import annotations

SUITE_ENVIRONMENT = {"OMP_NUM_THREADS": "1", "XLA_FLAGS": "--xla_backend_optimization_level=0"}
