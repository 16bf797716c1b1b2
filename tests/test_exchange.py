"""The star exchange's protocol with torch.distributed's point-to-point calls faked in-process (real
gloo ranks: test_straggler_multirank.py): who sends what to whom, and how a failed peer aborts
every rank at the same flush."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from otel_train import downwire
from otel_train.exchange import ExchangeFailed, StarExchange


class _Work:
    def __init__(self, error: str | None = None) -> None:
        self.error = error

    def wait(self, timeout: Any = None) -> bool:
        if self.error:
            raise RuntimeError(self.error)
        return True


class _FakeP2P:
    """Records isend / irecv; a receive fills the buffer with `incoming[peer]` or fails for `dead`."""

    def __init__(
        self, monkeypatch: pytest.MonkeyPatch, incoming: dict[int, torch.Tensor], dead: set[int]
    ) -> None:
        self.sent: dict[int, torch.Tensor] = {}
        self.received_from: list[int] = []
        self.incoming, self.dead = incoming, dead
        monkeypatch.setattr(dist, "isend", self.isend)
        monkeypatch.setattr(dist, "irecv", self.irecv)

    def isend(self, tensor: torch.Tensor, group: Any = None, tag: int = 0, group_dst: int = -1) -> _Work:
        self.sent[group_dst] = tensor.clone()
        return _Work()

    def irecv(self, tensor: torch.Tensor, group: Any = None, tag: int = 0, group_src: int = -1) -> _Work:
        self.received_from.append(group_src)
        if group_src in self.dead:
            return _Work("Connection closed by peer")
        tensor.copy_(self.incoming[group_src])
        return _Work()


def _up(rank: int) -> torch.Tensor:
    return torch.full((10,), float(rank), dtype=torch.float64)


def test_root_gathers_every_row_then_answers_each_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    p2p = _FakeP2P(monkeypatch, {r: _up(r) for r in range(1, 4)}, set())
    answers = downwire.answers(4, 20, None)
    answers[:, downwire.H_FLUSH_INTERVAL] = torch.arange(4, dtype=torch.float64)  # tell the rows apart
    got = StarExchange(object(), 0, 4, 5.0).run(_up(0), answers)
    assert p2p.received_from == [1, 2, 3] and sorted(p2p.sent) == [1, 2, 3]
    assert [int(p2p.sent[r][downwire.H_FLUSH_INTERVAL]) for r in (1, 2, 3)] == [1, 2, 3]  # row r to rank r
    assert got.records is not None and got.records[:, 0].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert int(got.down[downwire.H_FLUSH_INTERVAL]) == 0


def test_a_missing_row_aborts_the_others_at_the_same_flush(monkeypatch: pytest.MonkeyPatch) -> None:
    p2p = _FakeP2P(monkeypatch, {r: _up(r) for r in (1, 3)}, {2})
    with pytest.raises(ExchangeFailed, match=r"no row from rank\(s\) \[2\].*Connection closed"):
        StarExchange(object(), 0, 4, 5.0).run(_up(0), downwire.answers(4, 20, None))
    assert sorted(p2p.sent) == [1, 3]  # nothing to the dead rank
    assert all(int(p2p.sent[r][downwire.H_STATUS]) == downwire.STATUS_ABORT for r in (1, 3))


def test_other_ranks_send_one_row_and_raise_on_abort(monkeypatch: pytest.MonkeyPatch) -> None:
    ok = downwire.answers(4, 50, None)[2]
    p2p = _FakeP2P(monkeypatch, {0: ok}, set())
    exchange = StarExchange(object(), 2, 4, 5.0)
    got = exchange.run(_up(2), None)
    assert got.records is None and downwire.decode(got.down, 2).flush_interval == 50
    assert list(p2p.sent) == [0] and p2p.received_from == [0]  # one send, one receive, both rank 0
    assert (exchange.sent_bytes, exchange.received_bytes) == (80, 8 * downwire.DOWN_LEN)
    aborted = ok.clone()
    aborted[downwire.H_STATUS] = float(downwire.STATUS_ABORT)
    p2p.incoming[0] = aborted
    with pytest.raises(ExchangeFailed, match="rank 0 found a failed peer"):
        exchange.run(_up(2), None)
