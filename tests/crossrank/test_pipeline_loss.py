"""Pipeline parallelism: only the last stage computes the loss, so rank 0 (the first stage) records
none. Its rows (run directory, bridges) take the job's loss from the job blocks that already ride
the one exchange per flush (`CrossRankReducer.job_row`): real gloo ranks, star and tree."""

from __future__ import annotations

import pytest
from helpers.multirank import run_ranks

from otel_train import semconv
from otel_train.core.buffer import Interval

FLUSHES = 4


def _interval(seq: int, loss: list[float]) -> Interval:
    steps = 10
    scalars = {semconv.LOSS.name: loss} if loss else {}
    return Interval(seq, seq * 10 + 9, 0.0, 1.0, steps, 0, 0, [0.1] * steps, {"forward": [0.05] * steps},
                    scalars=scalars)  # fmt: skip


def _losses(seq: int) -> list[float]:
    return [1.0 + seq + 0.1 * i for i in range(10)]


def _rank(rank: int, world: int, fanin: int, recorders: tuple[int, ...]) -> list[dict[str, float]]:
    """Each flush's `job_row` on rank 0; ranks in `recorders` record `_losses(seq)`."""
    import torch.distributed as dist

    from otel_train.config import Config
    from otel_train.crossrank.reducer import CrossRankReducer
    from otel_train.distributed import detect_identity

    config = Config(exchange_fanin=fanin, exchange_grace_s=5.0)
    reducer = CrossRankReducer(detect_identity(None), None, None, config)
    rows = []
    for seq in range(FLUSHES):
        dist.barrier()
        reducer.on_flush(_interval(seq, _losses(seq) if rank in recorders else []))
        rows.append(dict(reducer.job_row))
    assert reducer.disabled_reason is None, reducer.disabled_reason
    return rows


@pytest.mark.multirank
@pytest.mark.parametrize(("world", "fanin"), [(4, 16), (4, 2)], ids=["star", "tree"])
def test_rank_0_rows_take_the_last_stages_loss(world: int, fanin: int) -> None:
    rows = run_ranks(world, _rank, (fanin, (world - 1,)), timeout=240)[0]
    keys = (semconv.LOSS.key, semconv.LOSS_MIN.key, semconv.LOSS_MAX.key)
    for seq, row in enumerate(rows):
        expected = (sum(_losses(seq)) / 10, min(_losses(seq)), max(_losses(seq)))
        assert tuple(row.get(key) for key in keys) == pytest.approx(expected), (seq, rows)


@pytest.mark.multirank
def test_a_rank_0_with_its_own_loss_keeps_its_row() -> None:
    rows = run_ranks(2, _rank, (16, (0, 1)), timeout=240)[0]
    assert rows == [{}] * FLUSHES


def _session_rank(rank: int, world: int, out: str) -> None:
    """A whole session: only the last rank (the pipeline's last stage) records the loss."""
    import torch.distributed as dist

    import otel_train as ot

    ot.init(output_dir=out, run_name="pp", run_id="pp", prometheus_port=0, verbosity=0, hardware=False,
            log_interval=5)  # fmt: skip
    for step in range(20):
        with ot.step(step):
            if rank == world - 1:
                ot.record("loss", 2.0 + step)
            dist.barrier()
    ot.shutdown()


def test_rank_zeros_rows_hold_the_last_stages_loss_in_a_whole_session(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import json

    run_ranks(2, _session_rank, (str(tmp_path),), timeout=120)
    rows = [json.loads(line) for line in (tmp_path / "pp" / "metrics.rank0.jsonl").read_text().splitlines()]
    losses = [(r["step"], r["train/loss"]) for r in rows if "train/loss" in r]
    assert losses, "rank 0's rows hold no train/loss"
    assert all(2.0 <= loss <= 21.0 for _, loss in losses)
    assert losses[-1][0] == 19 and losses[-1][1] == sum(range(17, 22)) / 5  # the last flush: steps 15-19
