"""`python -m pipeline_ops ...` = the `trainium-runs` console script."""

import sys

from pipeline_ops.cli import main

sys.exit(main())
