"""W&B bridge in offline mode, read back from the `.wandb` transaction log (no mock of wandb).

wandb.init + finish spawns wandb-core (~1.5 s), so there is one full round-trip test here and one in
the conformance test; mode resolution is tested without starting W&B.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.readback import find_wandb_offline_runs, read_wandb_offline

from otel_train.bridges.errors import BridgeDisabled, BridgeSetupError
from otel_train.bridges.threaded import ThreadedSink
from otel_train.bridges.wandb import WandbSink, has_wandb_credentials, resolve_mode
from otel_train.config import Config, config_as_dict

pytest.importorskip("wandb")

MARKER = "SENTINEL-WANDB-c0ffee"


def test_offline_round_trip_and_no_secret(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # W&B captures argv and the environment in its metadata unless told not to (failure-modes §5.4)
    monkeypatch.setattr("sys.argv", ["train.py", f"--wandb_key={MARKER}"])
    monkeypatch.setenv("MY_SERVICE_TOKEN", MARKER)
    run_dir = tmp_path / "runs" / "run-w"
    config = config_as_dict(Config(otlp_headers={"authorization": f"Bearer {MARKER}"}, run_name="run-w"))
    assert MARKER not in json.dumps(config)
    sink = WandbSink(
        run_dir,
        config,
        project="otel-train-tests",
        group="g1",
        tags=("unit",),
        mode="auto",
        run_name="run-w",
        run_id="job:42",
    )
    # what an earlier process of this run (a restart) left: W&B writes one offline directory a process
    earlier = run_dir / "wandb" / f"offline-run-20260101_000000-{sink.run_id}"
    earlier.mkdir(parents=True)
    for step in (10, 20, 30):
        sink.write_scalars(step, time.time(), {"train/loss": 10.0 / step, "throughput/tokens_per_s": 1e5})
    sink.write_text("samples/note", "**bold**", 20)
    sink.write_samples("samples/val", [("2+2=", "4")], 30)
    sink.write_histogram("grad/norm", [1.0, 2.0, 2.0, 3.0, float("inf")], 30)
    sink.write_hparams({"lr": 3e-4})
    sink.close({"train/loss": 1 / 3})
    shutil.rmtree(earlier)

    run = read_wandb_offline(run_dir)
    assert (
        run.exited
        and run.exit_code == 0
        and run.name == "run-w"
        and run.group == "g1"
        and run.tags == ["unit"]
    )
    assert re.fullmatch(r"job-42-[0-9a-f]{8}", run.run_id)  # ':' is not allowed in W&B ids
    # every series is plotted against the training step
    assert {"name": "train/step", "glob_name": "", "step_metric": ""} in run.metric_defs
    assert {"name": "", "glob_name": "*", "step_metric": "train/step"} in run.metric_defs
    assert run.series("train/loss") == [(10, 1.0), (20, 0.5), (30, pytest.approx(1 / 3))]
    assert run.series("throughput/tokens_per_s") == [(10, 1e5), (20, 1e5), (30, 1e5)]
    # one history row per flush: each scalar row carries all keys of that flush
    scalar_rows = [r for r in run.history if "train/loss" in r]
    assert len(scalar_rows) == 3 and all("throughput/tokens_per_s" in r for r in scalar_rows)
    [(step, note)] = run.series("samples/note")
    assert step == 20 and run.table(note) == {"columns": ["text"], "data": [["**bold**"]]}
    [(step, val)] = run.series("samples/val")
    assert step == 30 and run.table(val)["data"] == [["2+2=", "4"]]
    [(step, hist)] = run.series("grad/norm")
    assert step == 30 and hist["_type"] == "histogram" and sum(hist["values"]) == 4
    assert run.config["lr"] == 3e-4 and run.config["otlp_headers"] == "***"
    assert run.config["run_name"] == "run-w"
    assert run.summary["train/loss"] == pytest.approx(1 / 3)

    info = json.loads((run_dir / "wandb_run.json").read_text())
    assert info["id"] == run.run_id and info["offline"] is True
    # every process's directory, oldest first: `wandb sync` merges them into the one run
    assert info["dirs"] == [str(earlier), str(run.run_dir)]
    assert info["sync_command"] == f"wandb sync {earlier} {run.run_dir}"
    # the planted secret is nowhere in the run dir (config, .wandb log, metadata, debug logs)
    for path in run_dir.rglob("*"):
        if path.is_file() and not path.is_symlink():
            assert MARKER.encode() not in path.read_bytes(), path


def test_a_failed_run_ends_with_a_failing_exit_code(tmp_path: Path) -> None:
    """`close(failed=True)` (the training raised, or its process died): W&B shows the run failed."""
    sink = WandbSink(tmp_path / "run", {}, project="p", run_name="r", mode="offline")
    sink.write_scalars(0, time.time(), {"train/loss": 1.0})
    sink.close({}, failed=True)
    assert read_wandb_offline(tmp_path / "run").exit_code == 1


def test_no_run_is_created_when_nothing_was_written(tmp_path: Path) -> None:
    sink = WandbSink(tmp_path / "run", {}, project="p", run_name="r")
    sink.close({"train/loss": 1.0})
    assert not (tmp_path / "run" / "wandb").exists()


def test_rank_runs_are_named_and_grouped(tmp_path: Path) -> None:
    sink = WandbSink(tmp_path, {}, project="p", run_name="exp", run_id="u1", rank=3)
    assert (sink.run_name, sink.run_id, sink.group) == ("exp-rank3", "u1-rank3", "exp")
    single = WandbSink(tmp_path, {}, project="p", run_name="exp", run_id="u1")
    assert (single.run_name, single.run_id, single.group) == ("exp", "u1", None)


LONG_ID = "llama3-70b-pretrain-phase2-lr3e-4-bs2048-seq8192-node64-2026-11-29"  # 66 chars, a valid run_id


def test_wandb_ids_are_distinct_stable_and_keep_role_and_rank(tmp_path: Path) -> None:
    """Mapping characters W&B rejects, or cutting to 64 characters, never makes two ids one."""

    def wandb_id(run_id: str, rank: int | None = None, role: str = "") -> str:
        return str(WandbSink(tmp_path, {}, "p", run_name="r", run_id=run_id, rank=rank, role=role).run_id)

    assert Config(run_id=LONG_ID).run_id == LONG_ID
    ids = [
        *(wandb_id(LONG_ID, rank) for rank in (0, 1, 2)),
        *(wandb_id(f"{LONG_ID}-{role}", role=role) for role in ("actor", "critic")),
        wandb_id(f"{LONG_ID}-attempt1"),
        wandb_id(f"{LONG_ID}-attempt2"),
        wandb_id("exp.1"),
        wandb_id("exp-1"),
        wandb_id("x" * 128),
    ]
    assert len(set(ids)) == len(ids), ids
    assert all(re.fullmatch(r"[A-Za-z0-9_-]{1,64}", i) for i in ids), ids
    assert ids[0].endswith("-rank0") and ids[3].endswith("-actor") and ids[4].endswith("-critic")
    assert wandb_id(LONG_ID, 1) == ids[1]  # the same run id always names the same W&B run (resume)
    # ids W&B takes as they are stay as they were, so existing runs resume into the same W&B run
    assert [wandb_id("exp-1"), wandb_id("u1", 3), wandb_id("job_7-actor", role="actor")] == [
        "exp-1",
        "u1-rank3",
        "job_7-actor",
    ]


def test_each_role_logs_its_own_run_recording_the_run_id(tmp_path: Path) -> None:
    """Two roles of one job with a 66-character run id: two W&B runs, each id naming its role, and
    the config records the run id the job runs under (None there before: it is agreed at init)."""
    from otel_train.bridges.table import BridgePlace, specs

    config = Config(wandb=True, wandb_mode="offline", role="actor")  # no run_id: agreed at init
    ids = []
    for role in ("actor", "critic"):
        place = BridgePlace(run_dir=tmp_path / role, run_name="rl", run_id=LONG_ID, rank=0, role=role)
        [kwargs] = [k for _, cls, k in specs(config, place) if cls == "WandbSink"]
        sink = WandbSink(**kwargs)
        sink.write_scalars(1, time.time(), {"train/loss": 1.0})
        sink.close({})
        run = read_wandb_offline(tmp_path / role)
        assert run.run_id.endswith(f"-{role}") and run.series("train/loss") == [(1, 1.0)]
        assert run.config["otel_train/run_id"] == LONG_ID
        ids.append(run.run_id)
    assert ids[0] != ids[1]


def test_auto_mode_is_offline_without_credentials(tmp_path: Path) -> None:
    netrc = tmp_path / "netrc"
    env = {"NETRC": str(netrc)}
    assert resolve_mode("auto", env) == "offline"
    assert resolve_mode("auto", {**env, "WANDB_API_KEY": "k" * 40}) == "online"
    netrc.write_text("machine api.wandb.ai\n  login user\n  password " + "k" * 40 + "\n")
    netrc.chmod(0o600)
    assert has_wandb_credentials(env) and resolve_mode("auto", env) == "online"
    assert resolve_mode("auto", {**env, "WANDB_MODE": "disabled"}) is None  # wandb reads WANDB_MODE
    assert resolve_mode("offline", {"WANDB_API_KEY": "k"}) == "offline"


def test_unwritable_run_dir_names_the_path(tmp_path: Path) -> None:
    blocker = tmp_path / "file.txt"
    blocker.write_text("x")
    with pytest.raises(BridgeSetupError, match=re.escape("file.txt/run")):
        WandbSink(blocker / "run", {}, project="p")


def test_a_users_own_wandb_run_gets_a_warning_at_init(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The W&B bridge runs in the bridge process, so it never logs into a run the user started
    with wandb.init in the training process: init() says so, once."""
    import wandb

    import otel_train as ot

    user_run = wandb.init(project="mine", dir=str(tmp_path), mode="offline",
                          settings=wandb.Settings(silent=True, console="off"))  # fmt: skip
    try:
        with caplog.at_level(logging.WARNING, logger="otel_train"):
            ot.init(output_dir=str(tmp_path), run_name="userwb", wandb=True, prometheus_port=0, verbosity=0,
                    hardware=False)  # fmt: skip
            ot.shutdown()
    finally:
        user_run.finish()
    warned = [r.getMessage() for r in caplog.records if "W&B run is active" in r.getMessage()]
    assert len(warned) == 1 and user_run.id in warned[0] and "wandb=False" in warned[0], warned


def test_the_user_run_check_never_imports_wandb() -> None:
    code = (
        "import sys\n"
        "from otel_train.bridges.wandb import warn_if_user_run_active\n"
        "warn_if_user_run_active()\n"
        "assert 'wandb' not in sys.modules\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_wandbs_service_writes_the_offline_log_as_the_run_goes() -> None:
    """wandb-core keeps the `.wandb` log in memory between writes (every 15 s by default): a bridge
    process killed in between lost everything since. The sink asks for a write every second."""
    import wandb

    from otel_train.bridges.wandb import TRANSACTION_LOG_FLUSH_S

    settings = WandbSink._settings(wandb)
    assert settings.x_transaction_log_flush_interval == TRANSACTION_LOG_FLUSH_S <= 1.0
    assert wandb.Settings().x_transaction_log_flush_interval > TRANSACTION_LOG_FLUSH_S  # W&B's own default


def _closed_port() -> int:
    """A localhost port with nothing listening: connecting to it is refused at once."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture
def wandb_setup_forgotten() -> Iterator[None]:
    """After the test, W&B's process-wide set-up is torn down: it keeps the settings it started with
    (this test's unreachable WANDB_BASE_URL and key), which later tests' W&B runs in this process
    would otherwise use."""
    import wandb

    yield
    wandb.teardown()


@pytest.mark.usefixtures("wandb_setup_forgotten")
def test_an_unreachable_server_logs_offline_into_one_run_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Credentials but no reachable W&B server: the online init fails after WANDB_INIT_TIMEOUT and
    the run logs offline under the same run id, in one directory with all its data. The failed
    init's run id stays taken in wandb-core ("run ID ... is in use") until its service is stopped."""
    monkeypatch.delenv("WANDB_MODE", raising=False)  # "auto" then means online (credentials)
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{_closed_port()}")
    monkeypatch.setenv("WANDB_INIT_TIMEOUT", "2")
    run_dir = tmp_path / "run"
    sink = WandbSink(run_dir, {"lr": 1e-3}, project="p", mode="auto", run_name="r", run_id="job-7")
    with caplog.at_level(logging.WARNING, logger="otel_train"):
        for step in (1, 2, 3):
            sink.write_scalars(step, time.time(), {"train/loss": 1.0 / step})
        sink.write_hparams({"lr": 2e-3})
        sink.close({"train/loss": 1 / 3})

    run = read_wandb_offline(run_dir)  # exactly one offline directory
    assert run.run_id == "job-7" and run.exited and run.exit_code == 0
    assert run.series("train/loss") == [(1, 1.0), (2, 0.5), (3, pytest.approx(1 / 3))]
    assert run.config["lr"] == 2e-3 and run.summary["train/loss"] == pytest.approx(1 / 3)
    info = json.loads((run_dir / "wandb_run.json").read_text())
    assert info["id"] == "job-7" and info["offline"] is True
    assert info["sync_command"] == f"wandb sync {run.run_dir}"
    ours = [r.getMessage() for r in caplog.records if r.name == "otel_train" and r.levelno >= logging.WARNING]
    assert len(ours) == 1 and "logging offline" in ours[0] and info["sync_command"] in ours[0], ours


def test_when_wandb_cannot_start_at_all_the_bridge_is_off_after_one_try(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Online and offline init both fail: the bridge is off for the run, with one warning naming
    both errors. No init is retried (each would leave a run directory and wait up to
    WANDB_INIT_TIMEOUT); what it was sent is dropped and counted."""
    import wandb

    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    modes: list[str | None] = []

    def failing_init(self: WandbSink, wandb: object, mode: str | None) -> None:
        modes.append(mode)
        raise RuntimeError(f"no {mode} run")

    torn_down: list[object] = []
    monkeypatch.setattr(WandbSink, "_init", failing_init)
    monkeypatch.setattr(wandb, "teardown", lambda *args: torn_down.append(args))
    sink = WandbSink(tmp_path / "run", {}, project="p", mode="auto", run_name="r")
    # retry_after_s=0: a backend that is merely disabled would be retried at every call
    threaded = ThreadedSink(sink, queue_size=64, max_consecutive_failures=3, retry_after_s=0.0)
    with caplog.at_level(logging.WARNING, logger="otel_train"):
        for step in range(10):
            threaded.write_scalars(step, time.time(), {"train/loss": 1.0})
        threaded.close({"train/loss": 1.0}, timeout=10)

    assert modes == ["online", "offline"] and len(torn_down) == 2  # each failed init released
    assert threaded.disabled and threaded.retries == 0 and threaded.dropped == 10
    ours = [r.getMessage() for r in caplog.records if r.name == "otel_train"]
    assert len(ours) == 1 and "off for the rest of this run" in ours[0], ours
    assert "no online run" in ours[0] and "no offline run" in ours[0]
    with pytest.raises(BridgeDisabled):
        sink.write_scalars(10, time.time(), {"train/loss": 1.0})
    assert modes == ["online", "offline"]
    assert not (tmp_path / "run" / "wandb_run.json").exists()


def _wandb_sink(config: Config, run_dir: Path) -> WandbSink:
    """The W&B sink as the bridge process builds it for `config` (bridges/table.py)."""
    from otel_train.bridges.table import BridgePlace, specs

    place = BridgePlace(run_dir=run_dir, run_name="wenv", run_id="job-7", rank=0)
    [kwargs] = [k for _, cls, k in specs(config, place) if cls == "WandbSink"]
    return WandbSink(**kwargs)


def test_wandbs_own_variables_name_the_project_directory_and_run_id(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """WANDB_PROJECT, WANDB_DIR and WANDB_RUN_ID are the user's W&B settings: the bridge adopts them
    where the user set no otel_train setting; a second bridge process resumes the same W&B run."""
    wandb_dir = tmp_path / "user-wandb"
    monkeypatch.setenv("WANDB_PROJECT", "userproj")
    monkeypatch.setenv("WANDB_DIR", str(wandb_dir))
    monkeypatch.setenv("WANDB_RUN_ID", "userrun123")
    run_dir = tmp_path / "runs" / "wenv"
    config = Config(wandb=True, wandb_mode="offline")
    for step in (1, 2):  # the second: a restarted bridge process
        sink = _wandb_sink(config, run_dir)
        sink.write_scalars(step, time.time(), {"train/loss": 1.0 / step})
        sink.close({})
    first, second = find_wandb_offline_runs(wandb_dir)
    # W&B names a second directory of the same id in the same second `...-userrun123-1`
    assert all("-userrun123" in path.name for path in (first, second)), (first, second)
    for path, step in ((first, 1), (second, 2)):
        run = read_wandb_offline(path)
        assert (run.run_id, run.project) == ("userrun123", "userproj")
        assert run.series("train/loss") == [(step, 1.0 / step)]
    assert not (run_dir / "wandb").exists()  # W&B wrote under WANDB_DIR only
    info = json.loads((run_dir / "wandb_run.json").read_text())
    assert (info["id"], info["project"], info["dirs"]) == (
        "userrun123",
        "userproj",
        [str(first), str(second)],
    )

    # otel_train's own setting, given by the user, wins (an explicit wandb.init argument, in W&B's words)
    chosen = _wandb_sink(Config(wandb=True, wandb_project="mine"), run_dir)
    assert chosen.project == "mine"
    monkeypatch.delenv("WANDB_PROJECT")
    assert _wandb_sink(config, run_dir).project == "otel-train"  # neither: otel_train's default


def test_a_disabled_run_claims_no_directory(tmp_path: Path) -> None:
    """WANDB_MODE=disabled (or wandb_mode): W&B's no-op run has a made-up id, entity "dummy" and a
    directory it never writes; wandb_run.json says the run is disabled and names none of them.
    (W&B reads WANDB_MODE once a process, so this process passes the mode.)"""
    run_dir = tmp_path / "run"
    sink = WandbSink(run_dir, {}, project="p", run_name="r", run_id="job-1", mode="disabled")
    sink.write_scalars(0, time.time(), {"train/loss": 1.0})
    sink.close({})
    info = json.loads((run_dir / "wandb_run.json").read_text())
    assert info["mode"] == "disabled" and info["offline"] is False
    assert info["id"] is info["entity"] is info["dir"] is info["sync_command"] is None and info["dirs"] == []
    assert find_wandb_offline_runs(tmp_path) == [] and not (run_dir / "wandb").exists()
