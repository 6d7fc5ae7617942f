"""The warp-specialised matmul's barriers (replicas/model/ws_matmul.py), as modelled by
tools/ws_protocol.py: every drawn interleaving of the loader and the two consumers, cooperative
and ping-pong, ends without a deadlock or a buffer reloaded while read; and the model catches
the mistake the ping-pong consumers' `turn` barriers mend, so its "ok" means something."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import ws_protocol  # noqa: E402


def test_the_protocol_holds_over_random_interleavings():
    assert ws_protocol.check(2000) == ""


def test_pingpong_consumers_skipping_each_others_steps_on_their_own_fail():
    """Consumer 1 starts n_k steps ahead, waiting for a buffer whose barrier is two phases behind:
    the parity cannot tell that phase from the one before, so the wait passes before the load."""
    with pytest.raises(AssertionError, match="multiplied buffer"):
        ws_protocol.run(tiles=4, n_k=6, stages=3, pingpong=True, rng=random.Random(0), turns=False)
