"""Shared by every test directory. Test helpers are modules of the `tests` package (tests.infra,
tests.e2e, tests.steps) and of `scripts` (stage_synth: the stage as the tests and the snapshot
diff synthesize it), imported by their package names."""

from __future__ import annotations

import os

# jsii's Node.js end-of-life banner would drown the test output (Node 20 on CI boxes); set before
# any test module imports aws_cdk (which starts Node).
os.environ.setdefault("JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION", "20")
os.environ.setdefault("JSII_SILENCE_WARNING_DEPRECATED_NODE_VERSION", "1")
