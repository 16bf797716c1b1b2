"""The exchange's shape is the job's, never one rank's environment (issue #48, part 1), on real
gloo ranks whose "nodes" are UTS namespaces with their own host names:

- a 6-rank job on a 4-GPU and a 2-GPU host (LOCAL_WORLD_SIZE 4 and 2, each right for its host)
  and a job where one rank has another OTEL_TRAIN_EXCHANGE_FANIN run to the end with every rank's
  telemetry; the rank whose fan-in differs says so once at init;
- the exact star is kept while the fan-in allows it (4 ranks as 2 nodes of 2: the Flight
  Recorder names the late rank), and where arrivals cannot be judged (a tree whose rank on
  another host answers to another rank than rank 0) rank 0 says why;
- a refusal at init on one rank (another role, an invalid exchange_fanin) is every rank's, at
  once, with one message naming the rank and the setting.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import Any

import pytest
from helpers.multirank import run_ranks

pytestmark = pytest.mark.multirank

CLONE_NEWUTS = 0x04000000
STEPS = 30
LOG_INTERVAL = 5


def _become_node(host: str) -> None:
    """This process gets its own UTS namespace and host name: a "node" of its own."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWUTS) != 0:
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWUTS) needs root")
    socket.sethostname(host)


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _place(rank: int, places: list[tuple[str, int, int]], env: dict[int, dict[str, str]]) -> _Warnings:
    host, local_world, local_rank = places[rank]
    _become_node(host)
    os.environ.update({"LOCAL_WORLD_SIZE": str(local_world), "LOCAL_RANK": str(local_rank)})
    os.environ.update(env.get(rank, {}))
    warnings = _Warnings()
    logging.getLogger("otel_train").addHandler(warnings)
    return warnings


def _job_target(
    rank: int, world: int, out: str, places: list[tuple[str, int, int]], env: dict[int, dict[str, str]]
) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    import otel_train as ot
    from otel_train.testing import current_session

    warnings = _place(rank, places, env)
    ot.init(
        output_dir=out, run_name="shape", verbosity=0, hardware=False, prometheus_port=0,
        log_interval=LOG_INTERVAL, collective_timeout_s=30.0,
    )  # fmt: skip
    session = current_session()
    views: list[int] = []  # rank 0: the ranks in each flush's cross-rank view
    if rank == 0:
        session.worker.add_listener(_ViewCounter(session.reducer, views))
    grad = torch.ones(16)
    for step in range(STEPS):
        with ot.step(step):
            dist.all_reduce(grad)  # the training's own collective: a rank that died stops the job here
            time.sleep(0.01)
    reducer = session.reducer
    ot.shutdown()
    return {
        "host": socket.gethostname(),
        "run_dir": str(session.run_dir),
        "disabled": reducer.disabled_reason,
        "collectives": reducer.collectives,
        "fanin": reducer.fanin,
        "star": getattr(reducer.exchange, "layout", None) is None,
        "views": views,
        "warnings": [m for m in warnings.messages if "exchange_fanin" in m],
    }


class _ViewCounter:
    """A flush listener after the reducer: how many ranks rank 0's cross-rank view held."""

    def __init__(self, reducer: Any, views: list[int]) -> None:
        self.reducer, self.views = reducer, views

    def on_flush(self, interval: Any) -> None:
        step = self.reducer.last_reductions.get("step")
        if step is not None and not interval.final:
            self.views.append(step.n)

    def close(self) -> None:
        pass


FOUR_PLUS_TWO = [("nodeA", 4, r) for r in range(4)] + [("nodeB", 2, r) for r in range(2)]
ONE_HOST = [("nodeA", 6, r) for r in range(6)]


@pytest.mark.parametrize(
    ("places", "env"),
    [(FOUR_PLUS_TWO, {}), (ONE_HOST, {5: {"OTEL_TRAIN_EXCHANGE_FANIN": "2"}})],
    ids=["4+2-gpus-defaults", "one-rank-fanin-2"],
)
def test_ranks_that_see_the_job_differently_agree_on_one_exchange(
    places: list[tuple[str, int, int]], env: dict[int, dict[str, str]], tmp_path: Path
) -> None:
    results = run_ranks(6, _job_target, (str(tmp_path), places, env), timeout=240)
    assert [r["host"] for r in results] == [p[0] for p in places]
    run_dir = Path(results[0]["run_dir"])
    for rank, res in enumerate(results):
        assert res["disabled"] is None, (rank, res)
        assert res["fanin"] == 16 and res["star"], (rank, res)  # rank 0's fan-in reaches every rank
        assert res["collectives"] >= STEPS // LOG_INTERVAL - 1, (rank, res)
        assert res["run_dir"] == str(run_dir)
        rows = (run_dir / f"metrics.rank{rank}.jsonl").read_text().splitlines()
        assert len(rows) >= STEPS // LOG_INTERVAL, rank
    # every rank's row in rank 0's view, at every flush but the first (warm-up may come late)
    assert results[0]["views"] and results[0]["views"][-1] == 6 and results[0]["views"].count(6) >= 4
    differ = [rank for rank, res in enumerate(results) if res["warnings"]]
    assert differ == ([5] if env else [])
    if env:
        (message,) = results[5]["warnings"]
        assert "rank 5 asked for 2" in message and "rank 0 for 16" in message, message
        events = [json.loads(line) for line in (run_dir / "events.rank5.jsonl").read_text().splitlines()]
        assert [e for e in events if e["event"] == "settings_mismatch" and "exchange_fanin" in e["message"]]


def _tree_target(
    rank: int, world: int, out: str, places: list[tuple[str, int, int]], env: dict[int, dict[str, str]]
) -> dict[str, Any]:
    """Only ot.step timed; rank 3 comes 20 ms late to every step's all_reduce."""
    import torch
    import torch.distributed as dist

    import otel_train as ot
    from otel_train.diagnostics import collectives
    from otel_train.testing import current_session

    collectives.MAX_READ_SHARE = 0.02  # seconds-long job: reads may take 2 % (see test_collective_lateness)
    _place(rank, places, env)
    events: list[dict[str, Any]] = []
    ot.init(
        output_dir=out, run_name="late", verbosity=0, hardware=False, prometheus_port=0,
        log_interval=LOG_INTERVAL, collective_timeout_s=30.0,
    )  # fmt: skip
    session = current_session()
    session.events.add_callback(lambda e, m, a: events.append({"event": e, "message": m, **a}))
    grad = torch.ones(16)
    for step in range(60):
        with ot.step(step):
            time.sleep(0.02 if rank == 3 else 0.0)
            dist.all_reduce(grad)
            time.sleep(0.005)
    reducer = session.reducer
    ot.shutdown()
    return {
        "star": getattr(reducer.exchange, "layout", None) is None,
        "stragglers": [e for e in events if e["event"] == "straggler"],
        "abstain": reducer.abstain_reason,
    }


TWO_NODES_OF_TWO = [("nodeA", 2, 0), ("nodeA", 2, 1), ("nodeB", 2, 0), ("nodeB", 2, 1)]
FR_ON = {"TORCH_FR_BUFFER_SIZE": "200"}


def test_two_nodes_of_two_keep_the_star_and_the_recorder_names_the_late_rank(tmp_path: Path) -> None:
    env = {r: FR_ON for r in range(4)}
    results = run_ranks(4, _tree_target, (str(tmp_path), TWO_NODES_OF_TWO, env), timeout=240, env=FR_ON)
    assert all(r["star"] for r in results), results
    reported = results[0]["stragglers"]
    assert reported and {e["rank"] for e in reported} == {3}, results[0]
    assert reported[0]["waiting_ranks"] == "0,1,2", reported[0]


def test_a_tree_whose_arrivals_cannot_be_judged_says_so(tmp_path: Path) -> None:
    # fan-in 2 per node: rank 0 heads rank 1 and rank 2 (node B's leader), which heads rank 3:
    # rank 3's clock offset is to rank 2, so arrivals at collectives cannot be compared on rank 0
    env = {r: {**FR_ON, "OTEL_TRAIN_EXCHANGE_FANIN": "2"} for r in range(4)}
    results = run_ranks(4, _tree_target, (str(tmp_path), TWO_NODES_OF_TWO, env), timeout=240, env=FR_ON)
    assert not results[0]["star"]
    abstain = results[0]["abstain"] or ""
    assert "arrivals at collectives" in abstain and "rank 3" in abstain, results[0]


def _refusing_target(rank: int, world: int, out: str, refuse: dict[str, Any]) -> dict[str, Any]:
    """Rank 2 refuses at init (refuse: the settings it alone gets); every rank reports what init
    did and how long it took."""
    import otel_train as ot
    from otel_train.config import ConfigError

    settings = refuse if rank == 2 else {}
    started = time.monotonic()
    try:
        ot.init(
            **{"output_dir": out, "run_name": "refused", "verbosity": 0, "hardware": False,
               "prometheus_port": 0, "collective_timeout_s": 60.0, **settings}
        )  # fmt: skip
    except ConfigError as exc:
        return {"refused": str(exc), "seconds": time.monotonic() - started}
    ot.shutdown()
    return {"refused": None, "seconds": time.monotonic() - started}


@pytest.mark.parametrize(
    "refuse", [{"exchange_fanin": 1}, {"role": "generation"}], ids=["exchange-fanin-1", "another-role"]
)
def test_a_refusal_on_one_rank_is_every_ranks_at_once(refuse: dict[str, Any], tmp_path: Path) -> None:
    results = run_ranks(4, _refusing_target, (str(tmp_path), refuse), timeout=240)
    setting = next(iter(refuse))
    assert setting in results[2]["refused"], results[2]
    for rank in (0, 1, 3):
        message = results[rank]["refused"]
        assert message is not None and "rank 2" in message and setting in message, (rank, message)
    # decided together, not after collective_timeout_s (60 s) in a collective the refused rank skips
    assert max(r["seconds"] for r in results) < 30.0, results
    assert not list(tmp_path.iterdir())  # no run directory was split off


def test_the_shape_comes_from_every_ranks_facts_and_nodes_of_any_size() -> None:
    from otel_train.crossrank import decide_shape, node_key
    from otel_train.crossrank.tree import layout

    keys = [node_key("nodeA", 0)] * 4 + [node_key("nodeB", 2)] * 2
    shape = decide_shape([2, 2, 2, 2, 16, 16], keys)  # rank 0's fan-in, whatever the others say
    assert shape.fanin == 2 and shape.nodes == (4,)
    tree = layout(6, shape.fanin, nodes=shape.nodes)
    assert tree.parent == (-1, 0, 1, 1, 1, 4)  # node B's ranks answer to its leader, rank 4
    # the star whenever the fan-in reaches every rank, whatever the nodes say
    assert layout(4, 16, nodes=(2,)).star and layout(6, 5, nodes=(4,)).star
    assert node_key("nodeA", 0) == node_key("nodeA", 0) != node_key("nodeA", 1)
