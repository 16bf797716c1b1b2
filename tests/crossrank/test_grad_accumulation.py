"""A straggler under DDP gradient accumulation (`no_sync()`): several micro-batches per `ot.step`,
each timing data / forward / backward, and the gradient all-reduce only in the last one's
backward. Real gloo ranks (CPU), a full otel_train session per rank.

Each timer ends several times a step, so its arrival in the step is its LAST end there (where the
rank reaches the step's one synchronization): a rank slower in every micro-batch is chronically
late by the sum of its micro-batches' delays, and the other rank waits for it in backward. The
phase is named by each timer's time per step, not by the first last end that is late; backward's
own, where the other rank waits, counts that wait back in.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

import pytest
from helpers.multirank import DEFAULT_FR, run_ranks

pytestmark = [pytest.mark.multirank]

LOG_INTERVAL = 5
MICRO_BATCHES = 4
SLOW_S = 0.010  # the slow rank's extra time in every micro-batch


def train(rank: int, world: int, out_dir: str, slow_phase: str) -> list[dict[str, Any]]:
    """20 steps of 4 micro-batches, rank 1 slower in each `slow_phase`; rank 0's straggler events."""
    import torch

    import otel_train as ot
    from otel_train.testing import current_session

    events: list[dict[str, Any]] = []
    ot.init(output_dir=out_dir, run_name="acc", verbosity=0, log_interval=LOG_INTERVAL, hardware=False,
            collective_timeout_s=60.0)  # fmt: skip
    session = current_session()
    session.events.add_callback(
        lambda e, m, a: events.append(dict(a, message=m)) if e == "straggler" else None
    )
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(20):
        with ot.step(step, samples=8 * MICRO_BATCHES):
            for micro in range(MICRO_BATCHES):
                last = micro == MICRO_BATCHES - 1
                with model.no_sync() if not last else contextlib.nullcontext():
                    with ot.timer("data"):
                        x, y = torch.randn(8, 16), torch.randn(8, 1)
                    with ot.timer("forward"):
                        loss = (model(x) - y).pow(2).mean()
                        if rank == 1 and slow_phase == "forward":
                            time.sleep(SLOW_S)  # stands in for a slower device
                    with ot.timer("backward"):
                        if rank == 1 and slow_phase == "backward":
                            time.sleep(SLOW_S)  # its compute, before the all-reduce
                        loss.backward()  # the all-reduce: in the last micro-batch only
            with ot.timer("optimizer"):
                opt.step()
                opt.zero_grad()
    ot.shutdown()
    return events


RECORDER_OFF = {"TORCH_FR_BUFFER_SIZE": "0"}


@pytest.mark.parametrize(
    ("slow_phase", "recorder"), [("forward", "default"), ("backward", "default"), ("backward", "off")]
)
def test_a_rank_slower_in_every_micro_batch_is_chronic(
    slow_phase: str, recorder: str, tmp_path: Path
) -> None:
    """With torch's default Flight Recorder the verdict also holds the collective arrivals; with it
    off, the timers' arrivals alone."""
    env = RECORDER_OFF if recorder == "off" else DEFAULT_FR
    events = run_ranks(2, train, (str(tmp_path), slow_phase), timeout=240, env=env)[0]
    assert events, "the rank slower in every micro-batch was never reported"
    assert {(e["rank"], e["pattern"]) for e in events} == {(1, "chronic")}, events
    first = events[0]
    assert first["sync_phase"] == "backward" and first["waiting_ranks"] == "0", first["message"]
    # where it lost that time (data's last end already holds 3 slower micro-batches)
    assert (first["train.phase"], first["category"]) == (slow_phase, "compute"), first["message"]
    # its delay of every micro-batch: rank 0 waits that long once per step, in the last backward.
    # The last one's slower backward is inside the all-reduce: its arrival there sees it, the
    # timers' arrivals cannot.
    late = MICRO_BATCHES - 1 if (slow_phase, recorder) == ("backward", "off") else MICRO_BATCHES
    assert first["lateness_ms"] == pytest.approx(late * SLOW_S * 1000, rel=0.3)
    assert first["wait_ms"] == pytest.approx(late * SLOW_S * 1000, rel=0.3)
    assert bool(first["collective"]) == (recorder == "default"), first["message"]
