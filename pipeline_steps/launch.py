"""torchrun for the multi-node steps: `python -m pipeline_steps.launch <torchrun arguments>`.

The same launcher (torch.distributed.run), with one difference: a rendezvous that does not
complete ends with exit 75 (retryable), recorded where the entrypoint reads worker codes
(errors.record_exit_code). torchrun itself exits 1 when a node never joins within `--rdzv_conf
timeout` or the main node's store cannot be reached; no worker has run then, so nothing else
records a code and Batch would not retry what is a late or lost node, not a bug. Every other
outcome (success, a failed worker, a signal) is torchrun's own.
"""

from __future__ import annotations

import logging
import sys

from torch.distributed import DistError
from torch.distributed.elastic.rendezvous import RendezvousError
from torch.distributed.run import main as torchrun

from .errors import ExitCode, record_exit_code

log = logging.getLogger("pipeline_steps.launch")


def main(argv: list[str] | None = None) -> int:
    try:
        torchrun(argv)
    except (RendezvousError, DistError) as exc:
        # Static rendezvous: DistStoreError (main node: not every node joined in time) or
        # DistNetworkError (child node: the main node's store unreachable); c10d: RendezvousError.
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        logging.basicConfig(level=logging.INFO, stream=sys.stderr)
        log.error("the rendezvous of the nodes did not complete (%s: %s); transient, exit %d (retried)",
                  type(exc).__name__, detail, ExitCode.RETRYABLE)
        record_exit_code(ExitCode.RETRYABLE)
        return int(ExitCode.RETRYABLE)
    return int(ExitCode.OK)


if __name__ == "__main__":
    sys.exit(main())
