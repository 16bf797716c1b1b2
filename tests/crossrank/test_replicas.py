"""Data-parallel replica checks (replicas.py): batches fingerprinted by ot.watch and parameter norms,
compared across ranks on the per-flush exchange. The block's encoding and the comparisons on
synthetic rows, then real DDP on real gloo ranks: a DataLoader without DistributedSampler, one with,
a replica whose gradient sync fails, and ordinary DDP for 500 steps."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.events import Events
from helpers.multirank import run_ranks

import otel_train as ot
from otel_train import semconv as sc
from otel_train.core.buffer import Interval
from otel_train.crossrank.replicas import (
    ALL_RANKS,
    EXT_LEN,
    MAX_FINGERPRINTS,
    REL_TOL,
    ReplicaCheck,
    decode,
    divergence,
    duplicate_batches,
    encode,
)
from otel_train.testing import current_session

LABELS = ("embed", "mid", "head")


def _interval(fps: list[tuple[int, list[float]]], norms: list[float] | None, step: int = 9) -> Interval:
    interval = Interval(seq=0, step=step, wall_time=0.0, elapsed_s=1.0, steps=1, tokens=0, samples=0)
    interval.batch_fingerprints = fps
    if norms is not None:
        interval.layer_param_norms = [(step, LABELS, norms)]
    return interval


def _blocks(*intervals: Interval, keys: tuple[float, ...] | None = None) -> torch.Tensor:
    keys = keys or (ALL_RANKS,) * len(intervals)
    return torch.tensor([encode(i, k) for i, k in zip(intervals, keys, strict=True)], dtype=torch.float64)


def test_block_round_trip_keeps_the_latest_fingerprints_and_norms() -> None:
    fps = [(s, [float(s), float(s * s) + 1]) for s in range(MAX_FINGERPRINTS + 2)]
    block = encode(_interval(fps, [1.0, 2.0, 3.0]), 4.0)
    assert len(block) == EXT_LEN
    row = decode(3, block)
    assert row.rank == 3 and row.key == 4.0
    assert sorted(row.fingerprints) == list(range(2, MAX_FINGERPRINTS + 2))  # the latest travel
    assert row.param_step == 9 and row.norms == [1.0, 2.0, 3.0]
    assert decode(0, encode(_interval([], None), ALL_RANKS)).param_step == -1


def test_identical_batches_at_the_same_step_are_found_and_zero_batches_skipped() -> None:
    same = [(10, [5.0, 17.0])]
    rows = [decode(r, b) for r, b in enumerate(_blocks(_interval(same, None), _interval(same, None),
                                                        _interval([(10, [5.0, 18.0])], None)).tolist())]  # fmt: skip
    assert duplicate_batches(rows) == (10, {(0, 1): 10})
    # the same fingerprint at different steps is not a duplicate; all-zero batches prove nothing
    rows = [decode(0, encode(_interval([(10, [5.0, 17.0])], None), -1)),
            decode(1, encode(_interval([(11, [5.0, 17.0])], None), -1))]  # fmt: skip
    assert duplicate_batches(rows)[1] == {}
    zeros = [(4, [0.0, 0.0])]
    rows = [decode(r, encode(_interval(zeros, None), -1)) for r in (0, 1)]
    assert duplicate_batches(rows)[1] == {}


def test_divergence_names_the_first_layer_above_the_tolerance() -> None:
    base = [1.0, 2.0, 3.0]
    rows = [decode(0, encode(_interval([], base), -1)),
            decode(1, encode(_interval([], [1.0, 2.0 * (1 + 3 * REL_TOL), 3.5]), -1)),
            decode(2, encode(_interval([], [1.0, 2.0 * (1 + REL_TOL / 10), 3.0]), -1))]  # fmt: skip
    worst, first, ranks = divergence(rows)
    assert first == 1 and ranks == [0, 1] and worst == pytest.approx(0.5 / 3.5)
    assert divergence(rows[::2])[1] is None  # within float noise
    nan = [decode(r, encode(_interval([], [float("nan"), 2.0, 3.0]), -1)) for r in (0, 1)]
    assert divergence(nan) == (0.0, None, [])  # NaN everywhere is nonfinite_grad's event, not this one


def test_rank0_compares_only_data_parallel_peers_and_reports_once() -> None:
    events = Events()
    check = ReplicaCheck(0, None, events)
    same = [(10, [5.0, 17.0])]
    # ranks 0 and 1 are tensor-parallel peers (same batch on purpose), in two data-parallel groups
    blocks = _blocks(*(_interval(same, [1.0, 2.0, 3.0]) for _ in range(2)), keys=(0.0, 1.0))
    check.compare(blocks, [0, 1], False, LABELS)
    assert events.items == []
    blocks = _blocks(*(_interval(same, [1.0, 2.0, 3.0]) for _ in range(2)))
    for _ in range(3):
        check.compare(blocks, [0, 1], False, LABELS)
    [(_, message, attrs)] = events.named("data_not_sharded")
    assert attrs["ranks"] == "0,1" and "DistributedSampler" in message


def test_sharded_parameters_are_not_compared() -> None:
    events = Events()
    check = ReplicaCheck(0, None, events)
    check.compare(
        _blocks(_interval([], [1.0, 2.0, 3.0]), _interval([], [4.0, 5.0, 6.0])), [0, 1], True, LABELS
    )
    assert events.named("replica_divergence") == []
    check.compare(
        _blocks(_interval([], [1.0, 2.0, 3.0]), _interval([], [4.0, 5.0, 6.0])), [0, 1], False, LABELS
    )
    [(_, _, attrs)] = events.named("replica_divergence")
    assert attrs[sc.LAYER] == "embed" and attrs["ranks"] == "0,1"


def test_a_data_parallel_group_without_this_rank_is_refused() -> None:
    check = ReplicaCheck(3, None, None)
    with pytest.raises(ValueError, match="does not contain this rank"):
        check.set_data_parallel_group([0, 1])
    check.set_data_parallel_group([2, 3])
    assert check.key == 2.0


# --- real DDP on real gloo ranks ---------------------------------------------------------------------


def _ddp_rank(rank: int, world: int, output_dir: str, mode: str, steps: int) -> dict[str, Any]:
    import os

    from torch import nn
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    os.environ["OTEL_TRAIN_OUTPUT_DIR"] = output_dir
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(256, 8), torch.randn(256, 1))
    sampler = None if mode in ("unsharded", "own_group") else DistributedSampler(data, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=8, sampler=sampler, shuffle=False)
    inner = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    model = DistributedDataParallel(inner)
    opt = (
        torch.optim.AdamW(model.parameters(), lr=1e-2)
        if mode == "long"
        else torch.optim.SGD(model.parameters(), lr=0.05)
    )
    ot.init(prometheus_port=0, verbosity=0, hardware=False, log_interval=10, run_name="replicas")
    session = current_session()
    # "own_group": every rank its own data-parallel group, as tensor-parallel peers would name theirs
    ot.watch(model, every=5, data_parallel_group=[rank] if mode == "own_group" else None)
    step = 0
    while step < steps:
        for x, y in loader:
            if step >= steps:
                break
            with ot.step(step):
                opt.zero_grad()
                if mode == "failed_sync":
                    _step_with_failed_sync(model, x, y, rank)
                else:
                    nn.functional.mse_loss(model(x), y).backward()
                opt.step()
            step += 1
    measured = session.reducer.replicas.max_divergence
    ot.shutdown()
    path = Path(output_dir) / "replicas" / f"events.rank{rank}.jsonl"
    events = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    wanted = [e for e in events if e["event"] in ("data_not_sharded", "replica_divergence")]
    return {"events": wanted, "max_divergence": measured}


def _step_with_failed_sync(model: Any, x: torch.Tensor, y: torch.Tensor, rank: int) -> None:
    """A hand-written gradient sync (DDP's own turned off with no_sync on both ranks) with a bug on
    rank 1: it joins the all-reduce but never copies the averaged gradient back, so it steps with its
    own local gradient. Both ranks issue the same collectives: nothing hangs."""
    import torch.distributed as dist
    from torch import nn

    with model.no_sync():
        nn.functional.mse_loss(model(x), y).backward()
    grads = [p.grad for p in model.parameters()]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    if rank == 0:
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


def _flushes_until(events: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [e for e in events if e["event"] == name]


@pytest.mark.multirank
def test_ddp_without_distributed_sampler_is_named(tmp_path: Path) -> None:
    # 20 steps, a flush every 10, a watched step every 5: two flushes
    results = run_ranks(2, _ddp_rank, (str(tmp_path), "unsharded", 20), timeout=120)
    [event] = _flushes_until(results[0]["events"], "data_not_sharded")
    assert event["ranks"] == "0,1" and event["step"] in (5, 10, 15)
    assert _flushes_until(results[0]["events"], "replica_divergence") == []


@pytest.mark.multirank
def test_ddp_with_distributed_sampler_is_quiet(tmp_path: Path) -> None:
    results = run_ranks(2, _ddp_rank, (str(tmp_path), "sharded", 20), timeout=120)
    assert results[0]["events"] == [] and results[1]["events"] == []


@pytest.mark.multirank
def test_ranks_in_different_data_parallel_groups_are_not_compared(tmp_path: Path) -> None:
    # the same unsharded loader as above, but each rank names itself its own data-parallel group
    results = run_ranks(2, _ddp_rank, (str(tmp_path), "own_group", 20), timeout=120)
    assert results[0]["events"] == []


def test_ot_watch_names_the_data_parallel_group(tmp_path: Path) -> None:
    ot.init(output_dir=str(tmp_path), prometheus_port=0, verbosity=0, hardware=False)
    session = current_session()
    try:
        model = torch.nn.Linear(2, 2)
        ot.watch(model, data_parallel_group=[0])
        assert session.reducer.replicas.key == 0.0
        with pytest.raises(ValueError, match="does not contain this rank"):
            ot.watch(model, data_parallel_group=[1, 2])
    finally:
        ot.shutdown()


@pytest.mark.multirank
def test_a_replica_whose_gradient_sync_fails_is_named(tmp_path: Path) -> None:
    results = run_ranks(2, _ddp_rank, (str(tmp_path), "failed_sync", 40), timeout=120)
    [event] = _flushes_until(results[0]["events"], "replica_divergence")
    assert event["ranks"] == "0,1" and event[sc.LAYER] == "0" and event["step"] <= 30
    print("failed sync: relative difference", results[0]["max_divergence"], "at step", event["step"])


@pytest.mark.multirank
def test_ordinary_ddp_for_500_steps_never_diverges(tmp_path: Path) -> None:
    results = run_ranks(2, _ddp_rank, (str(tmp_path), "long", 500), timeout=240)
    assert _flushes_until(results[0]["events"], "replica_divergence") == []
    print("largest relative parameter-norm difference:", results[0]["max_divergence"])
    assert results[0]["max_divergence"] < REL_TOL / 100  # measured: 0.0 (the margin REL_TOL documents)
