"""The star exchange's protocol with torch.distributed's point-to-point calls faked in-process (real
gloo ranks: tests/crossrank/test_reducer_multirank.py, tests/faults/test_fault_ranks.py): who sends what to whom,
that nobody waits past the grace for a late peer (its posted receive stays posted and its row is
taken later), and how a silent peer turns the exchange off on every rank."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from otel_train.crossrank import down_row
from otel_train.crossrank.exchange import _ARRIVED, TRAILER_LEN, ExchangeFailed, StarExchange


class _Work:
    def wait(self, timeout: Any = None) -> bool:
        return True


class _FakeP2P:
    """Records isend / irecv. A posted receive stays empty until `deliver(peer, row)` writes the
    peer's message into it (its trailer last, as gloo does)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.sent: dict[int, list[torch.Tensor]] = {}
        self.posted: dict[int, list[torch.Tensor]] = {}
        self.inbox: dict[int, list[torch.Tensor]] = {}
        monkeypatch.setattr(dist, "isend", self.isend)
        monkeypatch.setattr(dist, "irecv", self.irecv)

    def isend(self, tensor: torch.Tensor, group: Any = None, tag: int = 0, group_dst: int = -1) -> _Work:
        self.sent.setdefault(group_dst, []).append(tensor.clone())
        return _Work()

    def irecv(self, tensor: torch.Tensor, group: Any = None, tag: int = 0, group_src: int = -1) -> _Work:
        self.posted.setdefault(group_src, []).append(tensor)
        inbox = self.inbox.get(group_src)
        if inbox:
            self.deliver(group_src, inbox.pop(0))
        return _Work()

    def deliver(self, peer: int, row: torch.Tensor) -> None:
        """The peer's next message lands in the oldest receive still empty (gloo pairs in order),
        or waits for the next one posted."""
        buffer = next((b for b in self.posted.get(peer, []) if b[-1] != _ARRIVED), None)
        if buffer is None:
            self.inbox.setdefault(peer, []).append(row)
            return
        buffer[:-TRAILER_LEN] = row
        buffer[-1] = _ARRIVED


def _up(rank: int) -> torch.Tensor:
    return torch.full((10,), float(rank), dtype=torch.float64)


def _answers(world: int) -> torch.Tensor:
    answers = down_row.answers(world, 20, None)
    answers[:, down_row.H_FLUSH_INTERVAL] = torch.arange(world, dtype=torch.float64)  # tell the rows apart
    return answers


def test_root_takes_every_row_then_answers_each_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    p2p = _FakeP2P(monkeypatch)
    exchange = StarExchange(object(), 0, 4, 5.0, grace_s=0.5)
    monkeypatch.setattr(exchange, "_post_receive", _only(exchange, p2p, {r: _up(r) for r in (1, 2, 3)}))
    got = exchange.run(_up(0), _answers(4))
    assert sorted(p2p.sent) == [1, 2, 3] and all(len(p2p.sent[r]) == 1 for r in (1, 2, 3))
    assert [int(p2p.sent[r][0][down_row.H_FLUSH_INTERVAL]) for r in (1, 2, 3)] == [1, 2, 3]  # row r to r
    assert all(p2p.sent[r][0][-1] == _ARRIVED for r in (1, 2, 3))  # every message ends in the trailer
    assert got.ranks == [0, 1, 2, 3] and got.records is not None
    assert got.records[:, 0].tolist() == [0.0, 1.0, 2.0, 3.0] and got.records.shape == (4, 10)
    assert all(len(p2p.posted[r]) == 1 for r in (1, 2, 3))  # one receive per peer per flush


def _only(exchange: StarExchange, p2p: _FakeP2P, rows: dict[int, torch.Tensor]) -> Any:
    """Post receives as the exchange does; the first one of each peer in `rows` gets its row at once."""
    post = exchange._post_receive

    def post_some(torch_: Any, peer: int, up_len: int) -> None:
        post(torch_, peer, up_len)
        if peer in rows:
            p2p.deliver(peer, rows.pop(peer))

    return post_some


def test_a_late_row_is_left_for_a_later_flush_never_waited_for_past_the_grace(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    p2p = _FakeP2P(monkeypatch)
    exchange = StarExchange(object(), 0, 3, 60.0, grace_s=0.05)
    monkeypatch.setattr(exchange, "_post_receive", _only(exchange, p2p, {1: _up(1)}))
    got = exchange.run(_up(0), _answers(3))  # waits the grace for rank 2, not the 60 s timeout
    assert got.ranks == [0, 1] and sorted(p2p.sent) == [1]  # rank 2's row has not come: no answer
    assert len(p2p.posted[2]) == 1  # its receive stays posted
    # Rank 2's row comes at last: its one receive takes it at the next flush, answered then.
    p2p.deliver(2, _up(2))
    p2p.deliver(1, _up(1) + 10)
    got = exchange.run(_up(0), _answers(3), expect=set())  # expect nobody: take what is there
    assert len(p2p.posted[2]) == 1 and got.ranks == [0, 1, 2] and len(p2p.sent[2]) == 1
    # Rank 1 sent an older row and the row of this flush: both taken, in order, each answered ...
    p2p.deliver(1, _up(1) + 20)
    p2p.deliver(1, _up(1) + 30)
    got = exchange.run(_up(0), _answers(3), expect={1}, current=lambda row: bool(row[0] >= 31))
    assert got.ranks == [0, 1, 1] and got.records is not None
    assert got.records[1:, 0].tolist() == [21.0, 31.0] and len(p2p.sent[1]) == 4
    # ... but a row beyond the one that reaches this flush waits for the next flush
    p2p.deliver(1, _up(1) + 40)
    p2p.deliver(1, _up(1) + 50)
    got = exchange.run(_up(0), _answers(3), expect={1})
    assert got.ranks == [0, 1] and got.records is not None and got.records[1, 0] == 41.0
    got = exchange.run(_up(0), _answers(3), expect={1})
    assert got.ranks == [0, 1] and got.records is not None and got.records[1, 0] == 51.0


def test_a_peer_silent_for_the_timeout_aborts_the_others(monkeypatch: pytest.MonkeyPatch) -> None:
    p2p = _FakeP2P(monkeypatch)
    exchange = StarExchange(object(), 0, 4, 0.2, grace_s=0.01)
    monkeypatch.setattr(exchange, "_post_receive", _only(exchange, p2p, {1: _up(1), 3: _up(3)}))
    exchange.run(_up(0), _answers(4))  # rank 2 is missing, not yet for the timeout
    assert int(p2p.sent[1][-1][down_row.H_STATUS]) == down_row.STATUS_OK
    time.sleep(0.25)
    p2p.deliver(1, _up(1))
    p2p.deliver(3, _up(3))
    with pytest.raises(ExchangeFailed, match=r"no row from rank\(s\) \[2\].*no row for 0.2 s"):
        exchange.run(_up(0), _answers(4))
    # every live peer gets ABORT as the answer to its next row (posted, never waited for)
    assert int(p2p.sent[1][-1][down_row.H_STATUS]) == down_row.STATUS_ABORT
    assert int(p2p.sent[3][-1][down_row.H_STATUS]) == down_row.STATUS_ABORT
    assert 2 not in p2p.sent  # nothing to the silent rank


def test_other_ranks_send_one_row_skip_while_unanswered_and_raise_on_abort(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    p2p = _FakeP2P(monkeypatch)
    exchange = StarExchange(object(), 2, 4, 5.0, grace_s=0.01)
    got = exchange.run(_up(2), None)  # rank 0 does not answer within the wait
    assert got.sent and got.down is None and len(p2p.sent[0]) == 1 and len(p2p.posted[0]) == 1
    got = exchange.run(_up(2), None)  # one row unanswered: this flush's row still goes up
    assert got.sent and len(p2p.sent[0]) == 2
    got = exchange.run(_up(2), None)  # MAX_UNANSWERED rows unanswered: this flush sends nothing
    assert not got.sent and exchange.skipped == 1 and len(p2p.sent[0]) == 2
    ok = down_row.answers(4, 50, None)[2]
    p2p.deliver(0, ok)
    p2p.deliver(0, ok)
    got = exchange.run(_up(2), None)  # both answers came: taken, and this flush's row goes up
    assert got.sent and len(p2p.sent[0]) == 3
    assert got.down is not None and down_row.decode(got.down, 2).flush_interval == 50
    assert exchange.sent_bytes == 3 * 8 * (10 + TRAILER_LEN)
    aborted = ok.clone()
    aborted[down_row.H_STATUS] = float(down_row.STATUS_ABORT)
    p2p.deliver(0, aborted)
    with pytest.raises(ExchangeFailed, match="rank 0 found a failed peer"):
        exchange.run(_up(2), None)


def test_other_ranks_give_up_after_twice_the_timeout_without_an_answer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _FakeP2P(monkeypatch)
    exchange = StarExchange(object(), 1, 2, 0.1, grace_s=0.01)
    exchange.run(_up(1), None)
    exchange.run(_up(1), None)
    time.sleep(0.25)
    with pytest.raises(ExchangeFailed, match=r"no answer from rank 0 for 0\.2 s"):
        exchange.run(_up(1), None)
