"""otel_train.integrations.megatron against the real components: Megatron-Core 0.16.1's `Timers` on
2 gloo ranks, Megatron Bridge 0.6.2's real `CallbackManager` (its callbacks module, imported alone
from the downloaded wheel), and a Bridge `logger:` YAML section mapped to `ot.init()` settings."""

from __future__ import annotations

import importlib.util
import os
import sys
import time
import zipfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml
from helpers.events import log_messages
from helpers.multirank import run_ranks

import otel_train as ot
from otel_train import adapters
from otel_train.config_loading import load_config
from otel_train.testing import current_session

if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
    if os.environ.get("CI"):  # make test installs it (pyproject's dev extra): missing is a failure
        raise ImportError("megatron-core==0.16.1 is not installed")
    pytest.skip("megatron-core==0.16.1 not installed (make test installs it)", allow_module_level=True)

REPO = Path(__file__).resolve().parents[2]
BRIDGE_WHEEL = "megatron_bridge-0.6.2-py3-none-any.whl"
NAMES = ["forward-backward", "forward-compute", "backward-compute", "optimizer"]
STEPS, LOG_INTERVAL, MICRO_BATCHES = 16, 4, 2
FORWARD_S, SLOW_FACTOR = 0.02, 2.0


def neutralise_cuda() -> None:
    """TEST ONLY, CPU box: Megatron's `Timer.start/stop` call `torch.cuda.synchronize()`
    unconditionally and `Timers._get_elapsed_time_all_ranks` allocates on
    `torch.cuda.current_device()`; without CUDA both raise. Exactly these two calls are replaced
    (a no-op sync, the CPU as current device); the `gpu` variant runs unpatched."""
    import torch

    torch.cuda.synchronize = lambda device=None: None  # type: ignore[assignment]
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]


class Intervals:
    """Flush listener keeping every interval's phases (what otel_train exports per rank)."""

    def __init__(self) -> None:
        self.phases: dict[str, float] = {}
        self.counts: dict[str, int] = {}

    def on_flush(self, interval: Any) -> None:
        for name, values in interval.phases.items():
            self.phases[name] = self.phases.get(name, 0.0) + sum(values)
            self.counts[name] = self.counts.get(name, 0) + len(values)

    def close(self) -> None:
        pass


def megatron_job(
    rank: int,
    world: int,
    patch: bool,
    slow_rank: int,
    out_dir: str,
    log_option: str = "all",
    timing: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A Megatron-shaped data-parallel step: forward-backward (level 1) holding per-micro-batch
    forward-compute / backward-compute (level 2), the gradient all-reduce inside the last
    backward (as DDP does), then the optimizer (level 1). Megatron's `Timers(2, log_option)`;
    `timing`: otel_train's own timing settings for `ot.init()` (none: Megatron's level decides)."""
    import logging

    import torch
    import torch.distributed as dist

    if patch:
        neutralise_cuda()
    from megatron.core.timers import Timers

    from otel_train.integrations.megatron import instrument

    records = log_messages("megatron.core.timers", logging.INFO)
    logging.getLogger("megatron.core.timers").setLevel(logging.INFO)

    timers = Timers(2, log_option)
    instrument(timers)
    events: list[dict[str, Any]] = []
    ot.init(
        output_dir=out_dir, run_name="megatron", verbosity=0, log_interval=LOG_INTERVAL, hardware=False,
        prometheus_port=0, collective_timeout_s=60.0, **(timing or {}),
    )  # fmt: skip
    session = current_session()
    seen = Intervals()
    session.worker.add_listener(seen)
    session.events.add_callback(lambda e, m, a: events.append(dict(a)) if e == "straggler" else None)
    model = torch.nn.Linear(16, 16)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(4, 16)
    forward_s = FORWARD_S * (SLOW_FACTOR if rank == slow_rank else 1.0)
    for step in range(STEPS):
        adapters.begin_step(step)
        timers("forward-backward", log_level=1).start()
        for mb in range(MICRO_BATCHES):
            timers("forward-compute", log_level=2).start()
            time.sleep(forward_s)
            loss = model(x).pow(2).mean()
            timers("forward-compute").stop()
            timers("backward-compute", log_level=2).start()
            loss.backward()
            if mb == MICRO_BATCHES - 1:
                for p in model.parameters():  # DDP's gradient all-reduce: the synchronisation
                    dist.all_reduce(p.grad)
            timers("backward-compute").stop()
        timers("forward-backward").stop()
        timers("optimizer", log_level=1).start()
        opt.step()
        opt.zero_grad()
        timers("optimizer").stop()
        adapters.end_step(tokens=64)
    ot.shutdown()
    # Megatron's own numbers: its per-rank totals, and its log string (printed on the last rank).
    mine = timers._get_elapsed_time_all_ranks(NAMES, reset=False, barrier=False)[rank].tolist()
    timers.log(NAMES, normalizer=1.0, reset=False)
    return {
        "otel": seen.phases,
        "counts": seen.counts,
        "megatron": dict(zip(NAMES, mine, strict=True)),
        "log": records,
        "events": events,
    }


def _check_megatron_job(results: list[dict[str, Any]], slow_rank: int) -> None:
    for rank, res in enumerate(results):
        assert res["counts"] == {
            "forward-backward": STEPS, "optimizer": STEPS,
            "forward-compute": STEPS * MICRO_BATCHES, "backward-compute": STEPS * MICRO_BATCHES,
        }  # fmt: skip
        for name in NAMES:
            # Every duration is Megatron's own (Timer.active_time), to the nanosecond.
            assert res["otel"][name] == pytest.approx(res["megatron"][name], abs=1e-6), (rank, name)
    log = "\n".join(results[-1]["log"])  # Megatron's output, unchanged
    if "times across ranks (ms):" in log:  # log_option "all": every rank's total in ms
        for rank, res in enumerate(results):
            for name in NAMES:
                block = log.split(f"\n  {name}:")[1]
                line = next(x for x in block.splitlines() if x.strip().startswith(f"rank {rank:2d}:".strip()))
                assert float(line.split(":")[1]) == pytest.approx(res["otel"][name] * 1e3, abs=0.0051)
    else:  # "minmax": the least and the greatest rank total in ms
        assert "(min, max) time across ranks (ms):" in log, log
        for name in NAMES:
            line = next(x for x in log.splitlines() if x.strip().startswith(f"{name} ."))
            low, high = (float(v) for v in line.split(": (")[1].rstrip(")").split(","))
            totals = [res["otel"][name] * 1e3 for res in results]
            assert (low, high) == (
                pytest.approx(min(totals), abs=0.0051),
                pytest.approx(max(totals), abs=0.0051),
            )
    reported = [e for e in results[0]["events"]]
    assert reported, "the rank slowed in forward-compute was never named"
    assert {e["rank"] for e in reported} == {slow_rank}  # the waiter (in backward-compute) never
    first = reported[0]
    assert (first["train.phase"], first["category"], first["pattern"]) == (
        "forward-compute",
        "compute",
        "chronic",
    )
    # It arose before the gradient all-reduce and collapsed at it: the last backward-compute.
    assert first["sync_phase"] == "backward-compute" and first["waiting_ranks"] == str(1 - slow_rank)


@pytest.mark.multirank
def test_megatron_timers_on_two_gloo_ranks(tmp_path: Path) -> None:
    results = run_ranks(
        2, megatron_job, (True, 1, str(tmp_path), "all", {"timing_log_level": 2}), timeout=240
    )
    _check_megatron_job(results, slow_rank=1)


@pytest.mark.multirank
def test_megatron_log_level_is_followed_without_an_otel_train_level(tmp_path: Path) -> None:
    """`Timers(log_level=2, log_option="minmax")` and no otel_train timing setting at all: the
    level-2 timers Megatron enabled are exported with Megatron's totals, and the rank slow in
    forward-compute (rank 0 here) is named; the user chose the level once, on Megatron's object."""
    results = run_ranks(2, megatron_job, (True, 0, str(tmp_path), "minmax", None), timeout=240)
    _check_megatron_job(results, slow_rank=0)


@pytest.mark.gpu
@pytest.mark.multirank
def test_megatron_timers_unpatched_on_gpu(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA: Megatron's Timer syncs the device and allocates on it")
    results = run_ranks(
        2, megatron_job, (False, 1, str(tmp_path), "all", {"timing_log_level": 2}), timeout=240
    )
    _check_megatron_job(results, slow_rank=1)


def test_elapsed_reads_and_skipped_timers_are_not_phases(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)  # see neutralise_cuda
    from megatron.core.timers import Timers

    from otel_train.integrations.megatron import instrument
    from otel_train.testing import capture_metrics

    timers = Timers(1, "minmax")
    held = timers("forward-backward", log_level=1)
    assert instrument(timers) is timers and instrument(timers) is timers  # same object, idempotent
    assert type(timers).__name__ == "Timers" and isinstance(timers, Timers)
    with capture_metrics(log_interval=100, run_dir_enabled=False, timing_log_level=1):
        seen = Intervals()
        session = current_session()
        assert session is not None
        session.worker.add_listener(seen)
        timers("interval-time", log_level=0).start()
        for step in range(3):
            adapters.begin_step(step)
            # Megatron names the level when it starts a timer; the Timer object held from before
            # instrument() is that same object, now reporting too.
            assert timers("forward-backward", log_level=1) is held
            held.start()
            held.stop()
            timers("fine-grained", log_level=2).start()  # above Megatron's level: DummyTimer
            timers("fine-grained").stop()
            assert timers("forward-backward").elapsed(reset=False) >= 0.0
            adapters.end_step()
        timers("interval-time").elapsed(barrier=False)  # Bridge's read of its cross-step clock
        timers("interval-time").stop()
    assert seen.counts == {"forward-backward": 3}


def _level_run(
    monkeypatch: pytest.MonkeyPatch, megatron_level: int, **settings: Any
) -> tuple[Intervals, Any]:
    """Three Megatron-shaped steps on one process under `Timers(megatron_level, "minmax")` and
    `ot.init(**settings)`; also an otel_train timer of the user's own at level 2."""
    import torch

    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)  # see neutralise_cuda
    from megatron.core.timers import Timers

    from otel_train.integrations.megatron import instrument
    from otel_train.testing import capture_metrics

    timers = instrument(Timers(megatron_level, "minmax"))
    seen = Intervals()
    with capture_metrics(log_interval=100, run_dir_enabled=False, **settings):
        session = current_session()
        assert session is not None
        session.worker.add_listener(seen)
        for step in range(3):
            adapters.begin_step(step)
            timers("forward-backward", log_level=1).start()
            for _ in range(MICRO_BATCHES):
                timers("forward-compute", log_level=2).start()
                time.sleep(0.001)
                timers("forward-compute").stop()
                timers("backward-compute", log_level=2).start()
                timers("backward-compute").stop()
            timers("forward-backward").stop()
            timers("optimizer", log_level=1).start()
            timers("optimizer").stop()
            with ot.timer("users-own", level=2):  # not Megatron's: otel_train's level (1 when unset)
                pass
            adapters.end_step()
    return seen, timers


LEVEL_ONE = {"forward-backward": 3, "optimizer": 3}
LEVEL_TWO = {**LEVEL_ONE, "forward-compute": 3 * MICRO_BATCHES, "backward-compute": 3 * MICRO_BATCHES}


def test_megatron_level_two_is_exported_when_otel_train_has_no_level(monkeypatch: pytest.MonkeyPatch) -> None:
    seen, timers = _level_run(monkeypatch, 2)
    assert seen.counts == LEVEL_TWO  # the user's own level-2 timer still follows otel_train's default, 1
    for name in LEVEL_TWO:  # Megatron's own totals
        assert seen.phases[name] == pytest.approx(timers(name).elapsed(reset=False), abs=1e-6), name


def test_megatron_level_one_timers_object_keeps_level_two_off(monkeypatch: pytest.MonkeyPatch) -> None:
    seen, _ = _level_run(monkeypatch, 1)  # Megatron hands out its DummyTimer for level 2
    assert seen.counts == LEVEL_ONE


@pytest.mark.parametrize(
    ("settings", "env", "expected"),
    [
        ({"timing_log_level": 1}, None, LEVEL_ONE),
        ({}, "1", LEVEL_ONE),  # OTEL_TRAIN_TIMING_LOG_LEVEL is as explicit as the kwarg
        ({"timing_log_level": 0}, None, {}),
        ({"timing_log_level": 2}, None, {**LEVEL_TWO, "users-own": 3}),
    ],
    ids=["kwarg-1", "env-1", "kwarg-0", "kwarg-2"],
)
def test_an_explicit_timing_log_level_wins_over_megatrons(
    monkeypatch: pytest.MonkeyPatch, settings: dict[str, Any], env: str | None, expected: dict[str, int]
) -> None:
    if env is not None:
        monkeypatch.setenv("OTEL_TRAIN_TIMING_LOG_LEVEL", env)
    seen, _ = _level_run(monkeypatch, 2, **settings)
    assert seen.counts == expected


# --- Megatron Bridge callback ---------------------------------------------------------------------


def bridge_wheel() -> Path | None:
    for root in (os.environ.get("OTEL_TRAIN_TOOLS"), str(REPO / ".tools")):
        if root and (Path(root) / "wheels" / BRIDGE_WHEEL).is_file():
            return Path(root) / "wheels" / BRIDGE_WHEEL
    return None


@pytest.fixture(scope="module")
def bridge_callbacks(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Bridge's real `megatron/bridge/training/callbacks.py` (standard library only), imported alone
    from the wheel `make test` downloads into .tools/wheels (`pip download --no-deps`)."""
    wheel = bridge_wheel()
    if wheel is None:
        message = f"{BRIDGE_WHEEL} missing: run `make bridge-wheel`"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    out = tmp_path_factory.mktemp("bridge")
    member = "megatron/bridge/training/callbacks.py"
    with zipfile.ZipFile(wheel) as zf:
        zf.extract(member, out)
    spec = importlib.util.spec_from_file_location("bridge_callbacks", out / member)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bridge_callbacks"] = module  # dataclasses resolve the module by name
    spec.loader.exec_module(module)
    return module


def _bridge_state(timers: Any) -> Any:
    """The parts of Bridge's GlobalState the callback reads (cfg, train_state, timers)."""
    logger = {"log_interval": 2, "timing_log_level": 1, "timing_log_option": "max"}
    cfg = SimpleNamespace(
        logger=logger,
        train=SimpleNamespace(train_iters=6, global_batch_size=8, micro_batch_size=2),
        model=SimpleNamespace(seq_length=16, hidden_size=32),
        optimizer=SimpleNamespace(lr=3e-4, adam_beta1=0.9),
        to_dict=lambda: {
            "train": {"train_iters": 6, "global_batch_size": 8},
            "logger": {"wandb_project": "p", "comet_api_key": "sekrit"},
        },
    )
    return SimpleNamespace(cfg=cfg, train_state=SimpleNamespace(step=0), timers=timers)


def test_bridge_callback_in_bridges_firing_order(bridge_callbacks: Any, monkeypatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)  # see neutralise_cuda
    from megatron.core.timers import Timers

    from otel_train.integrations.megatron import OtelTrainCallback
    from otel_train.testing import Capture

    callback = OtelTrainCallback({"run_dir_enabled": False, "prometheus_port": 0, "verbosity": 0})
    manager = bridge_callbacks.CallbackManager()
    manager.add(callback)  # Bridge registers it by its on_* methods: no Bridge base class needed
    for event in ("on_train_start", "on_train_step_start", "on_train_step_end", "on_eval_start"):
        assert manager.has_callbacks(event)
    timers = Timers(1, "max")
    state = _bridge_state(timers)
    optimizer = SimpleNamespace(param_groups=[{"lr": 0.5, "is_decoupled_lr": False}])
    ctx = bridge_callbacks.CallbackContext

    def fire(event: str, **fields: Any) -> None:
        manager.fire(event, ctx(state=state, model=[], user_state=manager.user_state, **fields))

    capture = Capture()
    fire("on_train_start", optimizer=optimizer)  # train.py: after model.train(), before the loop
    session = current_session()
    assert session is not None
    session.worker.add_sink(capture)
    seen = Intervals()
    session.worker.add_listener(seen)
    assert session.config.log_interval == 2 and session.config.timing_log_option == "max"
    # Bridge passes barrier=True to most of these; one process here, so no barrier.
    timers("interval-time", log_level=0).start()  # train.py, before the loop
    while state.train_state.step < 6:  # train.py's loop (Bridge 0.6.2), in its order
        fire("on_train_step_start", optimizer=optimizer)
        timers("forward-backward", log_level=1).start()
        timers("forward-backward").stop()
        timers("optimizer", log_level=1).start()
        timers("optimizer").stop()
        loss = {"lm loss": torch.tensor(2.0 - state.train_state.step * 0.1)}
        skipped = state.train_state.step == 3
        fire("on_train_step_end", optimizer=optimizer, loss_dict=loss, grad_norm=1.5, skipped_iter=skipped)
        state.train_state.step += 1  # Bridge increments after on_train_step_end
        if state.train_state.step % 2 == 0:  # training_log(): reads its iteration clock
            timers("interval-time").elapsed()
        if state.train_state.step == 4:
            timers("interval-time").stop()  # eval: interval-time stopped, eval-time around evaluate()
            timers("eval-time", log_level=0).start()
            timers("evaluate", log_level=0).start()  # eval.py: then on_eval_start
            fire("on_eval_start")
            for _ in range(2):
                fire("on_eval_step_start")
                timers("forward-backward", log_level=1).start()  # the forward-only schedule
                timers("forward-backward").stop()
                fire("on_eval_step_end")
            timers("evaluate").stop()
            fire("on_eval_end", total_loss_dict={"lm loss": torch.tensor(1.25)})
            timers("eval-time").stop()
            timers("save-checkpoint", log_level=0).start()  # save_checkpoint_and_time()
            fire("on_checkpoint_save")  # inside save_checkpoint (a synchronous save)
            timers("save-checkpoint").stop()
            timers("interval-time", log_level=0).start()
    fire("on_test_start")  # after training: evaluate_and_print_results on the test set
    fire("on_test_end", total_loss_dict={"lm loss": torch.tensor(1.0)})
    fire("on_train_end", optimizer=optimizer)
    assert current_session() is None  # the callback started it, so it shut it down
    # lm loss 2.0 - 0.1 * step: the last flush interval (log_interval 2) holds 1.6 and 1.5
    assert capture.last("train/loss") == pytest.approx(1.55)  # the interval's mean
    assert capture.last("train/loss_last") == pytest.approx(1.5)
    assert capture.last("train/grad_norm") == pytest.approx(1.5)
    assert capture.last("train/learning_rate") == pytest.approx(0.5)
    assert capture.last("eval/loss") == pytest.approx(1.25)
    assert sum(v for _, v in capture.series("train/skipped_steps")) == 1
    assert sum(v for _, v in capture.series("throughput/tokens")) == 6 * 8 * 16  # one rank: all of them
    assert sum(v for _, v in capture.series("throughput/samples")) == 6 * 8
    assert seen.counts["forward-backward"] == 6 + 2 and seen.counts["optimizer"] == 6
    assert seen.counts["evaluate"] == 1 and seen.counts["eval-time"] == 1
    assert "interval-time" not in seen.counts  # Bridge's cross-step clock: not a phase
    assert seen.counts["eval"] == 1 and seen.counts["save-checkpoint"] == 1 and seen.counts["test"] == 1
    assert capture.last("test/loss") == pytest.approx(1.0)
    (hparams,) = capture.hparams
    assert hparams["logger"]["comet_api_key"] == "***"
    assert hparams["train"]["global_batch_size"] == 8


def test_what_the_user_chose_wins_over_bridges_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """Bridge's `cfg.logger.log_interval` and `train_iters` are adopted, unless the user chose
    otel_train's own setting: here by `OTEL_TRAIN_<FIELD>` (a keyword wins the same way)."""
    from megatron.core.timers import Timers

    from otel_train.integrations.megatron import OtelTrainCallback

    quiet = {"run_dir_enabled": False, "prometheus_port": 0, "verbosity": 0, "hardware": False}
    for variables, expected in (
        ({}, (2, 6, "max")),
        ({"LOG_INTERVAL": "5", "TOTAL_STEPS": "50"}, (5, 50, "max")),
    ):
        for name, value in variables.items():
            monkeypatch.setenv(f"OTEL_TRAIN_{name}", value)
        callback = OtelTrainCallback(quiet)
        callback.on_train_start(SimpleNamespace(state=_bridge_state(Timers(1, "max"))))
        session = current_session()
        assert session is not None
        config = session.config
        assert (config.log_interval, config.total_steps, config.timing_log_option) == expected
        callback.on_train_end(SimpleNamespace())
        assert current_session() is None


def test_train_end_leaves_the_users_run_idle_and_flushed() -> None:
    """A run the user started outlives Bridge's training (`on_train_end`): its last steps are
    flushed then, and the pause that follows is no stall (`adapters.idle`)."""
    from otel_train.integrations.megatron import OtelTrainCallback

    ot.init(run_dir_enabled=False, prometheus_port=0, verbosity=0, hardware=False, log_interval=100)
    session = current_session()
    assert session is not None
    for step in range(3):
        with ot.step(step):
            pass
    OtelTrainCallback().on_train_end(SimpleNamespace())
    try:
        assert current_session() is session and session.last_step() == (2, None)
        assert session.worker.batches_put == 1  # the three steps, handed over at the end
    finally:
        ot.shutdown()


def test_a_decorated_forward_step_under_bridges_steps_counts_each_step_once() -> None:
    """Bridge marks the optimizer steps (`on_train_step_start`/`_end`); a user's `@ot.step` on the
    forward step function (one call per micro-batch) runs inside them: counted once, as Bridge's
    steps, the nested ones counted as `nested_step`."""
    from megatron.core.timers import Timers

    from otel_train.integrations.megatron import OtelTrainCallback
    from otel_train.testing import Capture

    @ot.step
    def forward_step(batch: int) -> int:
        return batch

    callback = OtelTrainCallback({"run_dir_enabled": False, "prometheus_port": 0, "verbosity": 0})
    state = _bridge_state(Timers(1, "max"))
    optimizer = SimpleNamespace(param_groups=[{"lr": 0.5, "is_decoupled_lr": False}])
    callback.on_train_start(SimpleNamespace(state=state, optimizer=optimizer))
    session = current_session()
    assert session is not None
    capture = Capture()
    session.worker.add_sink(capture)
    micro_batches = 4
    while state.train_state.step < 6:
        context = SimpleNamespace(
            state=state, optimizer=optimizer, loss_dict={}, grad_norm=None, skipped_iter=False
        )
        callback.on_train_step_start(context)
        for batch in range(micro_batches):
            forward_step(batch)
        callback.on_train_step_end(context)
        state.train_state.step += 1
    callback.on_train_end(SimpleNamespace(optimizer=optimizer))
    assert current_session() is None
    assert sum(v for _, v in capture.series("train/steps")) == 6
    assert sum(v for _, v in capture.series("otel_train/dropped/nested_step")) == 6 * micro_batches
    assert sum(v for _, v in capture.series("throughput/samples")) == 6 * 8  # Bridge's, not the inner steps'


def test_eval_and_test_batches_keep_the_stall_watchdog_counting_from_them() -> None:
    """Bridge's `on_eval_step_end` / `on_test_step_end` after the last step: the watchdog counts a
    long evaluation from its latest batch, not from the step's end; the eval/test span keeps it
    on eval_timeout_s after the last batch, until its end hook."""
    from otel_train.integrations.megatron import OtelTrainCallback

    ot.init(run_dir_enabled=False, prometheus_port=0, verbosity=0, hardware=False)
    session = current_session()
    assert session is not None
    with ot.step(0):
        pass
    callback = OtelTrainCallback()
    try:
        last = session.last_step()[1]
        for hook in (callback.on_eval_step_end, callback.on_test_step_end):
            time.sleep(0.01)
            hook(SimpleNamespace())
            assert session.last_step()[1] > last
            last = session.last_step()[1]
        # After the last batch Bridge reduces the losses across ranks: the open span keeps the
        # watchdog on eval_timeout_s until on_eval_end / on_test_end.
        context = SimpleNamespace(
            state=SimpleNamespace(train_state=SimpleNamespace(step=1)), total_loss_dict={}
        )
        for start, batch_end, end in (
            (callback.on_eval_start, callback.on_eval_step_end, callback.on_eval_end),
            (callback.on_test_start, callback.on_test_step_end, callback.on_test_end),
        ):
            assert not session.in_eval()
            start(context)
            batch_end(context)
            assert session.in_eval()
            end(context)
        assert not session.in_eval()
    finally:
        ot.shutdown()


def test_the_save_checkpoint_timer_gives_the_save_its_own_stall_timeout(monkeypatch) -> None:
    """Megatron's `save-checkpoint` timer starting is a save beginning (checkpoint_timeout_s for
    the watchdog) and its stop ends it."""
    import torch

    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)  # see neutralise_cuda
    from megatron.core.timers import Timers

    from otel_train.integrations.megatron import instrument

    ot.init(run_dir_enabled=False, prometheus_port=0, verbosity=0, hardware=False)
    session = current_session()
    assert session is not None
    timers = instrument(Timers(1, "max"))
    try:
        with ot.step(0):
            pass
        timers("save-checkpoint", log_level=0).start()
        assert session.saving()
        timers("save-checkpoint").stop()
        assert not session.saving()
    finally:
        ot.shutdown()


# --- LoggerConfig mapping --------------------------------------------------------------------------

BRIDGE_YAML = """
logger:
  log_interval: 10
  timing_log_level: 2
  timing_log_option: minmax
  tensorboard_dir: {tb}
  tensorboard_log_interval: 10
  log_timers_to_tensorboard: true
  log_memory_to_tensorboard: true
  log_energy: false
  log_throughput: true
  wandb_project: my_project
  wandb_exp_name: my_experiment
  wandb_entity: my_team
  wandb_save_dir: ./runs/wandb
  mlflow_experiment: my_mlflow_exp
  mlflow_run_name: my_mlflow_run
  mlflow_tracking_uri: http://mlflow.internal:5000
"""


def test_logger_config_maps_onto_settings(tmp_path: Path) -> None:
    from otel_train.integrations.megatron import settings_from_logger_config

    logger = yaml.safe_load(BRIDGE_YAML.format(tb=tmp_path / "tb"))["logger"]
    settings = settings_from_logger_config(logger)
    assert settings_from_logger_config(SimpleNamespace(**logger)) == settings  # the dataclass form too
    config = load_config(overrides=settings, environ={})  # valid settings, resolved as init() would
    assert (config.log_interval, config.timing_log_level, config.timing_log_option) == (10, 2, "minmax")
    assert config.tensorboard and config.output_dir == str(tmp_path / "tb")
    assert (config.wandb, config.wandb_project, config.wandb_entity) == (True, "my_project", "my_team")
    assert config.run_name == "my_experiment"  # W&B's name wins over MLflow's run name
    assert (config.mlflow, config.mlflow_experiment) == (True, "my_mlflow_exp")
    assert config.mlflow_tracking_uri == "http://mlflow.internal:5000"
    assert config.hardware
    assert settings_from_logger_config({"timing_log_level": -1}) == {"timing_log_level": 0}
    assert settings_from_logger_config({}) == {}


def test_mapped_fields_exist_in_bridges_logger_config() -> None:
    """The Bridge-own LoggerConfig fields the mapping reads, checked in the 0.6.2 wheel's source
    (the rest come from Megatron-LM's megatron.training LoggerConfig, not in any wheel here)."""
    import ast

    wheel = bridge_wheel()
    if wheel is None:
        if os.environ.get("CI"):
            pytest.fail(f"{BRIDGE_WHEEL} missing: run `make bridge-wheel`")
        pytest.skip(f"{BRIDGE_WHEEL} missing")
    with zipfile.ZipFile(wheel) as zf:
        tree = ast.parse(zf.read("megatron/bridge/training/config.py"))
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "LoggerConfig"]
    fields = {
        n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
    }
    assert {"timing_log_level", "mlflow_experiment", "mlflow_run_name", "mlflow_tracking_uri"} <= fields
