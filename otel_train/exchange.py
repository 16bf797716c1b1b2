"""The ONE telemetry exchange per flush, star-shaped around rank 0, on the dedicated gloo group:
every rank but rank 0 sends and receives a fixed number of bytes, whatever the job size.

    rank r > 0:  isend(its up row -> rank 0) and irecv(its down row <- rank 0); waits for the down row
    rank 0:      irecv(up row <- r) for every r; waits for them all; then isend(down row r -> r)

Why point-to-point, not a torch collective (checked against torch 2.13's ProcessGroupGloo and
gloo's source): gloo's all_gather gives every rank every row, (N-1) rows in and out per rank;
all_to_all with uneven splits is no cheaper in messages (gloo's `alltoallv` posts a send and a
receive to EVERY peer, zero-length or not); gather then scatter would be two collectives. Here a
rank r > 0 posts exactly one send and one receive: O(1) bytes and messages. Rank 0, a flat root,
pays O(N) (see `bench/exchange_model.py`; per-node leaders would cut rank 0's message count, not
its bytes, since the straggler model needs every rank's row).

Failure, and why rank 0 answers only after every row has arrived: the answer can then say whether
this exchange failed. When a peer's row does not arrive (it died: connection closed; or it stopped
flushing: gloo's timeout, `collective_timeout_s`), rank 0 answers ABORT to the others and raises,
and so do they: every rank disables its reducer at this same flush, and none is left waiting in an
exchange a peer would not issue. (A gloo timeout also closes every connection of the rank that
timed out, so a peer still waiting on it fails at once.) A rank r > 0 waits up to twice the timeout
for the answer, so that rank 0, which waits up to the timeout for the last row, always gives up
first. A peer that dies after its row arrived fails its own receive; rank 0 finds it at the next
flush (its row is missing) and aborts everyone then.

Clock (with `stamp_clock`): the up row's LAST float is the leaf's send time t1, written here just
before the send; rank 0 stamps, in that leaf's down row, t2 (its row arrived: after the wait, so
never early) and t3 (just before the answer leaves); the leaf's t4 is taken on receipt. All are
`clock()` (time.time: the Flight Recorder's clock). `collective_lateness.ClockEstimator` turns
them into the leaf's clock offset to rank 0 with an error bound.
"""

from __future__ import annotations

import datetime
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from otel_train import downwire

TAG = 18  # gloo slot of the exchange (the telemetry group carries nothing else)


class ExchangeFailed(RuntimeError):
    """The exchange failed on this rank (it disables the reducer for good)."""


@dataclass(frozen=True)
class Exchanged:
    records: Any | None  # rank 0: [world, up_len] float64, row r = rank r's up row; others: None
    down: Any  # this rank's down row (rank 0: its own answer row)
    received_at: float = math.nan  # leaf with stamp_clock: t4, when the answer arrived (clock())


class StarExchange:
    """One exchange per call (see the module doc). `group`: the gloo telemetry group; `rank` and
    `world` on that group; `timeout_s`: the group's timeout."""

    def __init__(self, group: Any, rank: int, world: int, timeout_s: float) -> None:
        self.group = group
        self.rank = rank
        self.world = world
        self.timeout_s = timeout_s
        self.sent_bytes = 0  # payload handed to gloo (tests and the bench)
        self.received_bytes = 0
        self.stamp_clock = False  # write t1..t3 (module doc); the caller reserves the row's last float
        self.clock: Callable[[], float] = time.time

    def run(self, up: Any, answers: Any | None) -> Exchanged:
        """Rank 0: `answers` is [world, DOWN_LEN] (downwire.answers); others: None."""
        if self.rank == 0:
            return self._root(up, answers)
        return self._leaf(up)

    def _leaf(self, up: Any) -> Exchanged:
        import torch
        import torch.distributed as dist

        down = torch.empty(downwire.DOWN_LEN, dtype=torch.float64)
        if self.stamp_clock:
            up[-1] = self.clock()  # t1
        send = _posted(dist.isend(up, group=self.group, group_dst=0, tag=TAG))
        recv = _posted(dist.irecv(down, group=self.group, group_src=0, tag=TAG))
        # Rank 0 answers after every row arrived (or it timed out): wait longer than it can.
        recv.wait(datetime.timedelta(seconds=2.0 * self.timeout_s))
        received_at = self.clock() if self.stamp_clock else math.nan  # t4
        send.wait()
        self.sent_bytes += up.numel() * up.element_size()
        self.received_bytes += down.numel() * down.element_size()
        if int(down[downwire.H_STATUS]) == downwire.STATUS_ABORT:
            raise ExchangeFailed("rank 0 found a failed peer in this exchange")
        return Exchanged(None, down, received_at)

    def _root(self, up: Any, answers: Any) -> Exchanged:
        import torch
        import torch.distributed as dist

        records = torch.empty((self.world, up.numel()), dtype=torch.float64)
        records[0] = up
        failed: dict[int, str] = {}
        pending: dict[int, Any] = {}
        for peer in range(1, self.world):
            try:
                work = dist.irecv(records[peer], group=self.group, group_src=peer, tag=TAG)
                pending[peer] = _posted(work)
            except Exception as exc:  # its connection is already gone
                failed[peer] = str(exc)
        for peer, work in pending.items():
            try:
                work.wait()  # the group's timeout
                if self.stamp_clock:
                    answers[peer, downwire.D_T2] = self.clock()  # t2: after the row arrived
                self.received_bytes += records[peer].numel() * records.element_size()
            except Exception as exc:
                failed[peer] = str(exc)
        if failed:
            answers[:, downwire.H_STATUS] = float(downwire.STATUS_ABORT)
        self._answer(answers, failed)
        if failed:
            first = min(failed)
            raise ExchangeFailed(f"no row from rank(s) {sorted(failed)} (rank {first}: {failed[first]})")
        return Exchanged(records, answers[0])

    def _answer(self, answers: Any, failed: dict[int, str]) -> None:
        """Send each live peer its down row. A send that fails is not this exchange's failure: that
        peer's own receive fails too, and its row is missing at the next flush."""
        import torch.distributed as dist

        sends = []
        for peer in range(1, self.world):
            if peer in failed:
                continue
            try:
                if self.stamp_clock:
                    answers[peer, downwire.D_T3] = self.clock()  # t3: before the answer leaves
                sends.append(_posted(dist.isend(answers[peer], group=self.group, group_dst=peer, tag=TAG)))
            except Exception:
                continue
        for work in sends:
            try:
                work.wait()
                self.sent_bytes += answers.shape[1] * answers.element_size()
            except Exception:
                continue


def _posted(work: Any | None) -> Any:
    """torch returns None for a rank outside the group (never the case for the telemetry group)."""
    if work is None:
        raise ExchangeFailed("this rank is not in the telemetry group")
    return work
