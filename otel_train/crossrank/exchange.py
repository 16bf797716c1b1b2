"""The one telemetry exchange per flush, star-shaped around rank 0, on the dedicated gloo group.

Every rank but rank 0 sends one fixed-size row up and takes one answer down; nothing waits for a
late peer, and a dead peer turns the exchange off on every rank. Also one edge of the tree
(`tree_exchange`) and the clock stamps of `collective_lateness`.
Design: docs/design/crossrank.md#exchange; costs: docs/scale.md#cross-rank-exchange.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from otel_train.crossrank import down_row

TAG = 18  # gloo slot of the exchange (the telemetry group carries nothing else)
TRAILER_LEN = 1  # the exchange appends one float to every message (docs/design/crossrank.md#exchange)
_ARRIVED = 2.0**40 + 18.0  # the trailer's value; a posted buffer holds NaN there until the message lands
POLL_S = 0.002  # how often a waiting worker looks at its posted buffers
SHUTDOWN_WAIT_S = 0.5  # at shutdown, how much longer the worker may wait for peers, in all
MAX_UNANSWERED = 2  # rank r > 0: rows up without an answer; beyond, a flush sends none (skipped)
# Rows of one peer held for a later flush of its parent (`reducer.RowPairing`, `tree_exchange`): a
# peer ahead by more flushes (not in lockstep) could never be paired, and they would grow with its lead.
MAX_HELD = 2


class ExchangeFailed(RuntimeError):
    """The exchange failed on this rank (it disables the reducer for good); `gone`: the rank
    found gone (-1: not known here), named on every rank it reaches (ABORT, a tree's FAILED)."""

    def __init__(self, message: str, gone: int = -1) -> None:
        named = gone >= 0 and "is gone" not in message
        super().__init__(message + (f": rank {gone} is gone" if named else ""))
        self.gone = gone


@dataclass(frozen=True)
class Exchanged:
    """What one call brought. Rank 0: `records` [n, up_len] float64, the rows taken at this call
    (its own first), from `ranks`; `down`: its own answer row. Other ranks: `records` None; `down`:
    the newest answer taken at this call, None when none came; `sent`: whether this call's row
    went up (False: the previous one is still unanswered)."""

    records: Any | None
    down: Any | None
    ranks: list[int] = field(default_factory=list)
    sent: bool = True
    # A leaf with stamp_clock: (t1 of the row `down` answers, t4 when `down` was taken), clock()
    stamps: tuple[float, float] = (math.nan, math.nan)


@dataclass
class _Posted:
    """A posted receive (and, on a rank r > 0, the send it answers)."""

    work: Any
    buffer: Any
    since: float  # monotonic time it was posted
    send: Any | None = None
    sent_at: float = math.nan  # rank r > 0 with stamp_clock: t1 of the row this receive answers


class StarExchange:
    """One exchange per call (docs/design/crossrank.md#exchange). `group`: the gloo telemetry group; `rank` and
    `world` on that group; `timeout_s`: the group's timeout; `grace_s`: how long rank 0 waits for
    the expected rows (a rank r > 0 waits twice that for its answer)."""

    def __init__(
        self,
        group: Any,
        rank: int,
        world: int,
        timeout_s: float,
        grace_s: float = 1.0,
        *,
        parent: int = 0,
        peers: Sequence[int] | None = None,
        down_len: int = down_row.DOWN_LEN,
    ) -> None:
        # `parent`, `peers`, `down_len`: a tree edge's (design page, "Tree edges")
        self.parent = parent
        self.peers = list(range(1, world)) if peers is None else list(peers)
        self.down_len, self.group, self.rank, self.world = down_len, group, rank, world
        self.timeout_s, self.grace_s = timeout_s, grace_s
        self.leaf_wait_s = 2.0 * grace_s
        self.sent_bytes = 0  # payload handed to gloo, trailers included (tests and the bench)
        self.received_bytes = 0
        self.skipped = 0  # rank r > 0: calls that sent no row (MAX_UNANSWERED rows had no answer)
        self._posted: dict[int, _Posted] = {}  # rank 0: the posted receive of each peer
        self._unanswered: deque[_Posted] = deque()  # rank r > 0: its rows' answer receives, in order
        self._missing_since: dict[int, float] = {}  # rank 0: peer -> first flush without its row
        self._prompt = True  # rank r > 0: the last answer came within leaf_wait_s (so wait for the next)
        self._parting: list[Any] = []  # works never waited for (turning off), kept with their buffers
        self._until = math.inf  # shutting down: no wait goes past this (monotonic) time
        self.stamp_clock = False  # write t1..t3 (module doc); the caller reserves the row's last float
        self.clock: Callable[[], float] = time.time
        self._stamps: tuple[float, float] = (math.nan, math.nan)  # the newest answer's (t1, t4)
        self.up_lens: dict[int, int] = {}  # each peer's message length (absent: the length of this rank's)

    def stamp(self, clock: Callable[[], float]) -> None:
        """Write t1..t3 from `clock`; the caller reserves the row's last float."""
        self.stamp_clock, self.clock = True, clock

    def stop_waiting(self) -> None:
        """Shutting down: every wait (the one in progress on the worker, and the queued flushes')
        ends within SHUTDOWN_WAIT_S from now, which leaves rows and answers of ranks in lockstep
        (milliseconds) in, and a peer that is gone or far behind costs the shutdown no more."""
        self._until = time.monotonic() + SHUTDOWN_WAIT_S

    def run(
        self,
        up: Any,
        answers: Any | None,
        expect: set[int] | None = None,
        current: Callable[[Any], bool] | None = None,
    ) -> Exchanged:
        """Rank 0: `answers` is [world, DOWN_LEN] (down_row.answers); it waits (up to the grace) for
        a row for which `current(row)` holds from each peer in `expect` (None: every peer; `current`
        None: any row). Others: `answers` None."""
        if self.rank == 0:
            return self.gather(up, answers, expect, current or (lambda row: True))
        return self.send_up(up)

    def answer(self, peers: Sequence[int], answers: Any) -> None:
        """Answer the rows `gather(defer=True)` took (one answer per row, in order)."""
        import torch

        self._finish([self._send(torch, answers, peer) for peer in peers])

    # --- rank r > 0 --------------------------------------------------------------------------------
    def send_up(self, up: Any) -> Exchanged:
        """The role of a rank r > 0 toward `parent`."""
        down = self._take_answers()
        if len(self._unanswered) >= MAX_UNANSWERED:
            if time.monotonic() - self._unanswered[0].since >= 2.0 * self.timeout_s:
                raise ExchangeFailed(
                    f"no answer from rank {self.parent} for {2.0 * self.timeout_s:g} s", self.parent
                )
            self.skipped += 1
            self._prompt = False
            return Exchanged(None, down, sent=False, stamps=self._stamps_of(down))
        buffer = self._post_row(up)
        if self._prompt:
            if self._poll(lambda: _arrived(buffer), self.leaf_wait_s):
                down = self._take_answers()
            else:
                self._prompt = False  # rank 0 is behind: do not wait at the next flushes either
        return Exchanged(None, down, stamps=self._stamps_of(down))

    def keep_alive(self, up: Any) -> Any | None:
        """A rank r > 0 that has not flushed for a while: take the answers that came and, when no
        row of this rank is still unanswered, send `up` (a keep-alive row, `up_row.keepalive`), so
        that rank 0, which takes a silent peer for gone after `timeout_s`, hears from it. Never
        waits. The newest answer taken (None: none); ABORT raises, as at a flush."""
        down = self._take_answers()
        if not self._unanswered:  # else rank 0 takes that row at its next flush, and hears from it then
            self._post_row(up)
        return down

    def _post_row(self, up: Any) -> Any:
        """Send `up` to the parent and post the receive of its answer; the answer's buffer."""
        import torch
        import torch.distributed as dist

        buffer = _empty(torch, self.down_len)
        sent_at = math.nan
        if self.stamp_clock:
            up[-1] = sent_at = self.clock()  # t1
        message = _framed(torch, up)
        try:
            recv = dist.irecv(buffer, group=self.group, group_src=self.parent, tag=TAG)
            send = dist.isend(message, group=self.group, group_dst=self.parent, tag=TAG)
        except RuntimeError as exc:  # its connection is gone (a parent that exited)
            raise ExchangeFailed(f"no connection to rank {self.parent} ({exc})", self.parent) from exc
        self.sent_bytes += message.numel() * message.element_size()
        self._unanswered.append(_Posted(recv, buffer, time.monotonic(), send, sent_at))
        return buffer

    def _stamps_of(self, down: Any | None) -> tuple[float, float]:
        return self._stamps if down is not None else (math.nan, math.nan)

    def _take_answers(self) -> Any | None:
        """The answers that came, in order; the newest (None: none came). ABORT raises."""
        down = None
        while self._unanswered and _arrived(self._unanswered[0].buffer):
            pending = self._unanswered.popleft()
            pending.work.wait()  # finished (its trailer is in): returns at once
            received_at = self.clock() if self.stamp_clock else math.nan  # t4
            self.received_bytes += pending.buffer.numel() * pending.buffer.element_size()
            down = pending.buffer[: self.down_len]
            self._stamps = (pending.sent_at, received_at)
            if int(down[down_row.H_STATUS]) == down_row.STATUS_ABORT:
                # Rank 0 may have posted it before taking this row, and never will: that send,
                # and any later row's, are left pending (kept alive with their buffers).
                self._parting.extend((p.work, p.send, p.buffer) for p in (pending, *self._unanswered))
                gone = int(down[down_row.H_GONE])
                raise ExchangeFailed(f"rank {self.parent} found a failed peer in this exchange", gone)
            if pending.send is not None:
                pending.send.wait()  # answered OK, so rank 0 took the row: done
            self._prompt = True  # answered by the next flush at the latest: rank 0 keeps pace
        return down

    # --- rank 0 ------------------------------------------------------------------------------------
    def gather(
        self,
        up: Any,
        answers: Any,
        expect: set[int] | None,
        current: Callable[[Any], bool],
        defer: bool = False,
    ) -> Exchanged:
        """The rank-0 role over `peers` (a tree's inner rank over its children): `up` is this rank's
        own message of the peers' length; `answers[peer]`: the answer row to each peer (a [world,
        DOWN_LEN] tensor or a dict). `defer`: the rows taken are answered later, by `answer`."""
        import torch

        failed: dict[int, str] = {}
        taken: list[tuple[int, Any]] = []
        sends: list[tuple[Any, Any]] = []
        waiting = set(self.peers) if expect is None else set(expect)
        done: set[int] = set()  # peers whose row for this flush (or a later one) is taken

        def drained() -> bool:
            for peer in self.peers:
                for row in self._drain(
                    torch, peer, self.up_lens.get(peer, up.numel()), failed, done, current
                ):
                    taken.append((peer, row))
                    if self.stamp_clock:
                        answers[peer][down_row.D_T2] = self.clock()  # t2: the row is in
                    # Answered at once: that peer's worker may be waiting for it before its next row
                    # (deferred: a tree's inner rank answers with its parent's answer, `answer`).
                    if not defer:
                        sends.append(self._send(torch, answers, peer))
            return not (waiting - done - set(failed))

        self._poll(drained, self.grace_s)
        self._finish(sends)
        now = time.monotonic()
        heard = {peer for peer, _ in taken}
        for peer in self.peers:
            if peer in heard or peer in failed:
                self._missing_since.pop(peer, None)
            elif now - self._missing_since.setdefault(peer, now) >= self.timeout_s:
                failed[peer] = f"no row for {self.timeout_s:g} s"
        if failed:
            first = min(failed)
            self.abort_peers(answers, list(failed), first)
            raise ExchangeFailed(
                f"no row from rank(s) {sorted(failed)} (rank {first}: {failed[first]})", first
            )
        taken.sort(key=lambda item: item[0])  # by rank, each peer's rows in the order they came
        rows: Any = [up, *(row for _, row in taken)]  # peers' lengths may differ (a tree's up_lens)
        rows = rows if self.up_lens else torch.stack(rows)
        own = answers[0] if self.rank == 0 else None  # rank 0's own answer (the star's)
        return Exchanged(rows, own, [self.rank, *(peer for peer, _ in taken)])

    def _poll(self, done: Callable[[], bool], limit_s: float) -> bool:
        """Worker thread: look every POLL_S until `done()` or `limit_s` passed; whether it is done."""
        deadline = time.monotonic() + limit_s
        while not done():
            if time.monotonic() >= min(deadline, self._until):
                return False
            time.sleep(POLL_S)
        return True

    def _drain(
        self,
        torch: Any,
        peer: int,
        up_len: int,
        failed: dict[int, str],
        done: set[int],
        current: Callable[[Any], bool],
    ) -> list[Any]:
        """The rows of `peer` that came, in order, up to the first that reaches this flush (a later
        row waits for the next flush, so a rank 0 whose worker lags still pairs each flush's rows).
        A receive is posted only while this flush still needs a row from that peer."""
        rows = []
        while peer not in done and peer not in failed:
            if peer not in self._posted:
                try:
                    self._post_receive(torch, peer, up_len)
                except RuntimeError as exc:  # gloo's DistBackendError: its connection is gone
                    failed[peer] = str(exc)
                    break
            pending = self._posted[peer]
            if not _arrived(pending.buffer):
                break
            del self._posted[peer]
            try:
                pending.work.wait()  # finished (its trailer is in): returns at once
            except RuntimeError as exc:  # gloo's DistBackendError: the message failed
                failed[peer] = str(exc)
                break
            self.received_bytes += pending.buffer.numel() * pending.buffer.element_size()
            row = pending.buffer[:up_len]
            rows.append(row)
            if current(row):
                done.add(peer)
        return rows

    def _post_receive(self, torch: Any, peer: int, up_len: int) -> None:
        import torch.distributed as dist

        buffer = _empty(torch, up_len)
        work = dist.irecv(buffer, group=self.group, group_src=peer, tag=TAG)
        self._posted[peer] = _Posted(work, buffer, time.monotonic())

    def _send(self, torch: Any, answers: Any, peer: int) -> tuple[Any, Any]:
        """Answer one row of `peer` (its down row), at once: the peer may be waiting for it."""
        import torch.distributed as dist

        if self.stamp_clock:
            answers[peer][down_row.D_T3] = self.clock()  # t3: just before the answer leaves
        message = _framed(torch, answers[peer])
        try:
            return dist.isend(message, group=self.group, group_dst=peer, tag=TAG), message
        except RuntimeError:  # gloo's DistBackendError: that peer's connection is gone
            return None, message

    def _finish(self, sends: list[tuple[Any, Any]]) -> None:
        """Wait for the answers sent. A send that fails is not this exchange's failure: that
        peer's own receive fails too, and its rows stop coming."""
        for work, message in sends:
            if work is None:
                continue
            try:
                work.wait()  # the peer posted its receive with its row: the send goes at once
                self.sent_bytes += message.numel() * message.element_size()
            except RuntimeError:  # gloo's DistBackendError: that peer's receive failed
                continue

    def abort_peers(self, answers: Any, failed: Sequence[int] = (), gone: int = -1) -> None:
        """Post ABORT (`answers[peer]`, status and the rank `gone` set here) to every peer not in `failed`."""
        import torch

        # Never waited for (the peer may never flush again); kept so the buffers outlive the sends.
        for peer in self.peers:
            answers[peer][down_row.H_STATUS] = float(down_row.STATUS_ABORT)
            answers[peer][down_row.H_GONE] = float(gone)
            if peer not in failed:
                work, message = self._send(torch, answers, peer)
                if work is not None:
                    self._parting.append((work, message))


def _empty(torch: Any, length: int) -> Any:
    """A receive buffer for a `length`-float message: its trailer NaN until the message lands."""
    buffer = torch.empty(length + TRAILER_LEN, dtype=torch.float64)
    buffer[-1] = math.nan
    return buffer


def _framed(torch: Any, row: Any) -> Any:
    return torch.cat([row.to(torch.float64), torch.tensor([_ARRIVED], dtype=torch.float64)])


def _arrived(buffer: Any) -> bool:
    return bool(buffer[-1].item() == _ARRIVED)
