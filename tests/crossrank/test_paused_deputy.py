"""A paused rank on REAL gloo ranks (8 processes): SIGSTOP longer than the exchange's waits, well
within its timeout, then SIGCONT. From then on the paused rank keeps its own step counter (as an
independent rank of an RL or evaluation job does), so it is behind every other rank's steps for the
rest of the run and its rows never pair again. In the star rank 0 so sees 7 of 8 ranks from then
on; in a tree of fan-in 2 the paused rank is rank 1, rank 0's deputy (`tree.layout`), which heads
every other rank, and rank 0 must see the same 7 of 8, not only itself.

Every other rank flushes rank 0's flush steps (rank 0 names them in a file, as its cadence would):
on a loaded machine a rank can be descheduled past the exchange's grace at any flush, and a rank
with a step counter of its own would then stay behind for good too. Each wait is on a condition
(rank 0's next flush, a view seen, a number of flushes), never on how fast a flush is."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from helpers.multirank import run_ranks

from tests.crossrank.test_reducer_multirank import _Events, _interval, _phases

pytestmark = pytest.mark.multirank

WORLD = 8
PERIOD_S = 0.3  # rank 0's pace between flushes (nothing asserts how fast a flush is)
GRACE_S = 0.2  # rank 0 waits this for a row, a rank with a parent twice this for its answer
TIMEOUT_S = 20.0  # collective_timeout_s: the pause stays well within it (else the exchange turns off)
PAUSE_S = 2.5  # many times every wait above ...
PAUSED_FLUSHES = 3  # ... and at least this many of rank 0's flushes: then rank 1 is behind for good
SEEN = 6  # flushes after the pause whose view must hold every rank but rank 1
MAX_FLUSHES = 200  # rank 0's bound on each wait (a flush takes >= PERIOD_S, loaded or not)


def paused_target(rank: int, world: int, fanin: int, shared: str) -> dict[str, Any]:
    """Rank 0 flushes until every rank was in its view, pauses rank 1, and flushes on until the
    other 7 were in its view at SEEN flushes after the pause; the others flush each of rank 0's
    flush steps (`shared`/seq) until it is done (`shared`/done)."""
    import torch.distributed as dist

    from otel_train.config import Config
    from otel_train.crossrank.reducer import CrossRankReducer
    from otel_train.distributed import create_telemetry_group, detect_identity

    identity = detect_identity(None)
    config = Config(collective_timeout_s=TIMEOUT_S, exchange_grace_s=GRACE_S, exchange_fanin=fanin)
    group = create_telemetry_group(identity, TIMEOUT_S)
    reducer = CrossRankReducer(identity, None, _Events(), config, group=group)
    pids: list[Any] = [None] * world
    dist.all_gather_object(pids, os.getpid())
    files = Path(shared)
    if rank != 0:
        _follow(rank, reducer, files)
        return {"disabled": reducer.disabled_reason}
    paired: list[int] = []  # the ranks in each flush's cross-rank view
    note = reducer.pairing.note

    def noted(left_out: Any, ranks: int, *args: Any) -> None:
        paired.append(ranks)
        note(left_out, ranks, *args)

    reducer.pairing.note = noted  # type: ignore[method-assign]
    before: list[int] = []  # rank 0's views before the pause
    after: list[int] = []  # ... and after rank 1 resumed (those during the pause: in neither)
    state, paused_at, paused_flushes = "before", 0.0, 0
    for seq in range(3 * MAX_FLUSHES):
        if after.count(WORLD - 1) >= SEEN or len(before) >= MAX_FLUSHES or len(after) >= MAX_FLUSHES:
            break
        _write(files / "seq", str(seq))
        paired.clear()
        reducer.on_flush(_interval(seq, _phases(0, seq, "balanced")))
        view = paired[-1] if paired else 0
        if state == "before":
            before.append(view)
            if view == WORLD:  # every rank in step: pause rank 1 (it keeps its own steps after)
                _write(files / "paused", "")
                os.kill(pids[1], signal.SIGSTOP)
                state, paused_at = "paused", time.monotonic()
        elif state == "paused":
            paused_flushes += 1
            if paused_flushes >= PAUSED_FLUSHES and time.monotonic() - paused_at >= PAUSE_S:
                os.kill(pids[1], signal.SIGCONT)
                state = "after"
        else:
            after.append(view)
        time.sleep(PERIOD_S)
    _write(files / "done", "")
    return {"before": before, "after": after, "disabled": reducer.disabled_reason}


def _follow(rank: int, reducer: Any, files: Path) -> None:
    """A rank other than 0: flush each step rank 0 flushes, once it names it; rank 1, once it was
    paused, one step of its own per flush of rank 0's instead (behind for good)."""
    last, own = -1, -1
    while not (files / "done").exists():
        text = (files / "seq").read_text() if (files / "seq").exists() else ""
        if not text or int(text) == last:
            time.sleep(0.005)  # rank 0's next flush: polled
            continue
        last = int(text)
        own = own + 1 if rank == 1 and (files / "paused").exists() else last
        reducer.on_flush(_interval(own, _phases(rank, own, "balanced")))


def _write(path: Path, text: str) -> None:
    """Write `path` whole (a reader never sees it half written)."""
    part = path.with_suffix(".part")
    part.write_text(text)
    os.replace(part, path)


@pytest.mark.parametrize("fanin", [16, 2], ids=["star", "fanin2"])
def test_a_paused_rank_1_costs_rank_0_only_that_ranks_row(fanin: int, tmp_path: Path) -> None:
    results = run_ranks(WORLD, paused_target, (fanin, str(tmp_path)), timeout=600)
    before, after = results[0]["before"], results[0]["after"]
    assert results[0]["disabled"] is None, results[0]
    assert before[-1:] == [WORLD], before  # every rank in rank 0's view before the pause
    # After the pause rank 1's steps are behind for good (never in rank 0's view again); every
    # other rank is (in the tree, through rank 1's place: not rank 0 alone), flush after flush.
    assert after.count(WORLD - 1) >= SEEN and WORLD not in after, (before, after)
