"""pipeline_steps.distributed: a lost peer is a retryable failure, anything else is not."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from pipeline_steps import distributed
from pipeline_steps.errors import ExitCode, RetryableError

TWO_RANKS = distributed.World("cpu", 0, 2, 0, torch.device("cpu"))
ONE_RANK = distributed.World("cpu", 0, 1, 0, torch.device("cpu"))
# What the surviving rank's loss.backward() raised when the other node was killed (torch 2.9, gloo).
GLOO_PEER_RESET = RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:538] Read error "
                               "[127.0.0.1]:4527: Connection reset by peer")


def test_a_lost_peer_becomes_the_retryable_exit_code():
    with pytest.raises(RetryableError, match="a peer of rank 0 of 2 went away .*Connection reset by peer") as info:
        with distributed.peer_failures_are_retryable(TWO_RANKS, "training"):
            raise GLOO_PEER_RESET
    assert info.value.exit_code == ExitCode.RETRYABLE
    with pytest.raises(RetryableError):
        with distributed.peer_failures_are_retryable(TWO_RANKS, "training"):
            raise dist.DistBackendError("NCCL communicator was aborted")


@pytest.mark.parametrize("world, error", [
    (TWO_RANKS, RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 5x6)")),  # a bug stays a bug
    (ONE_RANK, GLOO_PEER_RESET),  # no peers to lose
])
def test_other_errors_pass_through_unchanged(world, error):
    with pytest.raises(RuntimeError) as info:
        with distributed.peer_failures_are_retryable(world, "training"):
            raise error
    assert info.value is error
