"""`otel-train` as a user runs it: diagnose on whole, damaged and foreign run directories, doctor's
checks, usage errors, and `otel-train demo` pointing at the demo's place in a source checkout."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers.otlp_receiver import grpc_receiver, http_receiver, refused_endpoint, tarpit

from otel_train import cli
from otel_train.cli import main
from otel_train.diagnostics.hang_attribution import summarize
from otel_train.run_directory import RunFiles


def _write_hang(run_dir: Path, role: str = "") -> None:
    """Four ranks' summaries of one stall, as HangReporter writes them: ranks 0, 2 and 3 wait in
    all_reduce #7; rank 1 never reached it (its last collective is #6)."""
    for rank in range(4):
        last = 6 if rank == 1 else 7
        dump = {
            "pg_status": {"0": {"last_enqueued_collective": last, "last_completed_collective": 6}},
            "entries": [
                {
                    "process_group": ["0", "default_pg"],
                    "collective_seq_id": seq,
                    "profiling_name": "gloo:all_reduce",
                }
                for seq in range(3, last + 1)
            ],
        }
        summary = summarize(dump, (), rank, 4, f"host{rank}", run_dir / f"stacks.rank{rank}.0.txt", 12.0)
        summary["stall_timeout_s"] = 10.0
        files = RunFiles(run_dir, rank, role)
        files.collectives.write_text(json.dumps(summary), encoding="utf-8")


def _diagnose(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(["diagnose", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_diagnose_names_the_rank_that_never_reached_the_collective(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _write_hang(tmp_path)
    code, out, err = _diagnose([str(tmp_path)], capsys)
    assert code == 0 and err == "", err
    assert "summaries from ranks [0, 1, 2, 3] of 4" in out
    assert "rank 1 (host1) never reached all_reduce #7 of process group default_pg" in out, out
    assert "where rank(s) 0,2,3 wait" in out


@pytest.mark.parametrize("skewed", [1, 2])
def test_diagnose_reads_every_rank_of_the_stall_though_one_hosts_clock_is_off(
    skewed: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Rank `skewed`'s host clock is 60 s ahead (past the 10 s window): its written_at made the
    others' summaries look stale ("no verdict" when the culprit's clock was ahead, the waiting
    rank named when a waiter's was). The files' mtimes, one clock on a shared file system, tell."""
    _write_hang(tmp_path)
    path = RunFiles(tmp_path, skewed).collectives
    summary = json.loads(path.read_text())
    summary["written_at"] += 60.0
    path.write_text(json.dumps(summary))
    code, out, _ = _diagnose([str(tmp_path)], capsys)
    assert code == 0 and "summaries from ranks [0, 1, 2, 3] of 4" in out, out
    assert "rank 1 (host1) never reached all_reduce #7" in out, out


def test_diagnose_reads_the_stall_from_its_summaries_though_busy_ranks_answered_later(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Ranks 2 and 3 stalled in all_reduce #7; ranks 0 and 1, busy elsewhere, answered the question
    (marked progressing) 25 s later, past the 10 s window (a question asked again while the wait
    lasts). The stall's window is read back from its stall summaries, not from the newest answer
    (which left the waiting ranks out: no verdict)."""
    _write_hang(tmp_path)
    stalled_at = 1_000_000.0
    for rank in range(4):
        path = RunFiles(tmp_path, rank).collectives
        summary = json.loads(path.read_text())
        busy = rank in (0, 1)
        if busy:  # not in all_reduce #7, answering
            summary["groups"]["0"].update(last_enqueued=6, last_completed=6)
            summary["progressing"] = True
        summary["written_at"] = stalled_at + (25.0 if busy else 0.0)
        path.write_text(json.dumps(summary))
        os.utime(path, (summary["written_at"], summary["written_at"]))
    code, out, _ = _diagnose([str(tmp_path)], capsys)
    assert code == 0 and "summaries from ranks [0, 1, 2, 3] of 4" in out, out
    assert "rank 0 (host0), rank 1 (host1) have not reached all_reduce #7 of process group default_pg" in out
    assert "where rank(s) 2,3 wait: not stalled" in out, out


def test_diagnose_says_a_stall_outside_collectives_and_one_the_run_went_on_from(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Both ranks stalled in data loading (every collective they began was done): no rank "in the
    same collective"; and the run's metrics rows went on after the stall: it resolved."""
    for rank in range(2):
        dump = {"pg_status": {"0": {"last_enqueued_collective": 12, "last_completed_collective": 12}}}
        summary = summarize(dump, (), rank, 2, f"host{rank}", None, 0.0)
        summary["stall_timeout_s"] = 10.0
        RunFiles(tmp_path, rank).collectives.write_text(json.dumps(summary), encoding="utf-8")
    code, out, _ = _diagnose([str(tmp_path)], capsys)
    assert code == 1 and "no rank was inside a collective when it stalled" in out, out
    assert "same collective" not in out and "went on" not in out
    later = {"step": 40, "time": summary["written_at"] + 30.0, "train/loss": 1.0}
    RunFiles(tmp_path, 0).metrics.write_text(
        json.dumps({"step": 10, "time": 1.0}) + "\n" + json.dumps(later) + "\n"
    )
    code, out, _ = _diagnose([str(tmp_path)], capsys)
    assert "the run went on after this stall: its last metrics row (step 40) came 30 s later" in out, out


def test_diagnose_names_a_damaged_summary_instead_of_a_missing_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _write_hang(tmp_path)
    rank1 = RunFiles(tmp_path, 1).collectives
    rank1.write_bytes(rank1.read_bytes()[:60])  # a crash mid-write on a file system without rename
    code, out, err = _diagnose([str(tmp_path)], capsys)
    assert "skipped collectives.rank1.json: unreadable" in err, err
    assert code == 0 and "rank 1 (" not in out and "rank 1 left no readable Flight Recorder summary" in out, (
        out
    )


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"written_at": None}, "no valid written_at (None)"),
        ({"written_at": float("nan")}, "no valid written_at (nan)"),  # json reads NaN
        ({"stall_timeout_s": float("inf")}, "no valid stall_timeout_s (inf)"),
        ({"stall_timeout_s": None}, None),  # optional: read as no window
        ({"stall_timeout_s": "ten"}, "no valid stall_timeout_s ('ten')"),
        ({"world_size": "two"}, "no valid world_size ('two' for rank 3)"),
        ({"rank": True}, "no valid rank (True)"),
        # diagnose looks at every rank below the world size: a forged one would never end
        ({"rank": 10**12}, "no valid rank (1000000000000)"),
        ({"world_size": 3}, "no valid world_size (3 for rank 3)"),
        ({"world_size": 10**12}, "no valid world_size (1000000000000 for rank 3)"),
        ({"written_at": 10**400}, "no valid written_at (1000000"),  # float() would overflow
        ({"stall_timeout_s": 10**400}, "no valid stall_timeout_s (1000000"),
        ({"groups": {"0": {"last_enqueued": "7"}}}, "no valid groups"),
    ],
)
def test_diagnose_never_crashes_on_a_malformed_summary(
    change: dict[str, Any], reason: str | None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _write_hang(tmp_path)
    path = RunFiles(tmp_path, 3).collectives
    path.write_text(json.dumps({**json.loads(path.read_text()), **change}), encoding="utf-8")
    code, out, err = _diagnose([str(tmp_path)], capsys)
    assert code == 0 and "rank 1 (host1) never reached all_reduce #7" in out, (out, err)
    if reason is None:
        assert err == "" and "summaries from ranks [0, 1, 2, 3] of 4" in out
    else:
        assert f"skipped collectives.rank3.json: {reason}" in err, err
        assert "summaries from ranks [0, 1, 2] of 4" in out


def _diagnose_in_child(run_dir: Path) -> subprocess.CompletedProcess[str]:
    """`otel-train diagnose RUN_DIR` in its own process, which prints its peak RSS (KiB) last: the
    address space's own VmHWM (ru_maxrss would include the parent's peak, kept across exec). The
    timeout only guards against a reader that blocks for ever (it never measures speed)."""
    code = (
        "import re, sys\n"
        "from otel_train.cli import main\n"
        f"code = main(['diagnose', {str(run_dir)!r}])\n"
        "status = open('/proc/self/status').read()\n"
        "print('maxrss', re.search(r'VmHWM:\\s*(\\d+)', status).group(1))\n"
        "sys.exit(code)\n"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)


def _maxrss_kib(stdout: str) -> int:
    return int(stdout.rsplit("maxrss", 1)[1].split()[0])


@pytest.mark.parametrize("planted", ["fifo", "dev_zero"])
def test_diagnose_skips_a_fifo_or_a_device_named_like_a_summary_without_blocking(
    planted: str, tmp_path: Path
) -> None:
    _write_hang(tmp_path)
    RunFiles(tmp_path, 2).collectives.unlink()
    # a summary, the launch facts (hosts) and the metrics file (did the run go on?) are all read
    for path in (RunFiles(tmp_path, 2).collectives, RunFiles(tmp_path).env, tmp_path / "metrics.rank0.jsonl"):
        if planted == "fifo":
            os.mkfifo(path)  # nobody ever writes it: an open() without O_NONBLOCK waits for ever
        else:
            path.symlink_to("/dev/zero")  # endless: a read() to the end never ends
    done = _diagnose_in_child(tmp_path)
    assert "skipped collectives.rank2.json: unreadable (not a regular file)" in done.stderr, done.stderr
    assert done.returncode == 0 and "rank 1 (host1) never reached all_reduce #7" in done.stdout, done.stdout


def test_diagnose_skips_an_oversized_summary_before_reading_it(tmp_path: Path) -> None:
    _write_hang(tmp_path)
    baseline = _diagnose_in_child(tmp_path)
    path = RunFiles(tmp_path, 2).collectives
    # rank 2's own, valid summary padded to 100 MB: parsed whole, it took +0.7 GB
    with path.open("a", encoding="utf-8") as f:
        for _ in range(100):
            f.write(" " * (1 << 20))
    done = _diagnose_in_child(tmp_path)
    assert "skipped collectives.rank2.json: unreadable (" in done.stderr, done.stderr
    assert "more than the" in done.stderr and "summaries from ranks [0, 1, 3] of 4" in done.stdout
    assert _maxrss_kib(done.stdout) < _maxrss_kib(baseline.stdout) + 32 * 1024  # far below 100 MB


def test_diagnose_never_lets_one_ranks_file_stand_in_for_another(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _write_hang(tmp_path)
    rank0 = json.loads(RunFiles(tmp_path, 0).collectives.read_text(encoding="utf-8"))
    # rank 1's file claims to be rank 0, on another host and behind: read as rank 0 it would make
    # rank 0 the culprit and rank 1 the silent one
    forged = {**rank0, "host": "elsewhere", "written_at": rank0["written_at"] + 1}
    forged["groups"]["0"]["last_enqueued"] = 5
    RunFiles(tmp_path, 1).collectives.write_text(json.dumps(forged), encoding="utf-8")
    code, out, err = _diagnose([str(tmp_path)], capsys)
    assert "skipped collectives.rank1.json: claims rank 0, but its name is another rank's" in err, err
    assert "elsewhere" not in out and "summaries from ranks [0, 2, 3] of 4" in out, out
    assert code == 0 and "rank 1 left no readable Flight Recorder summary" in out, out


def test_diagnose_points_at_the_role_and_at_a_wrong_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _write_hang(tmp_path, role="trainer")
    code, out, _ = _diagnose([str(tmp_path)], capsys)
    assert code == 1 and "files of role(s) trainer: pass --role trainer" in out, out
    code, out, _ = _diagnose([str(tmp_path), "--role", "trainer"], capsys)
    assert code == 0 and "rank 1 (host1) never reached" in out
    code, out, _ = _diagnose(["--role=trainer", str(tmp_path)], capsys)  # flags before or after
    assert code == 0 and "rank 1 (host1) never reached" in out
    code, out, err = _diagnose([str(tmp_path / "nope")], capsys)
    assert code == 2 and out == "" and "nope does not exist" in err
    (tmp_path / "afile").write_text("x")
    code, _, err = _diagnose([str(tmp_path / "afile")], capsys)
    assert code == 2 and "is not a directory" in err
    empty = tmp_path / "empty"
    empty.mkdir()
    code, out, _ = _diagnose([str(empty)], capsys)
    assert code == 1 and "not a run directory (no config.json): give the job's run directory" in out, out
    (empty / "config.json").write_text("{}")  # a run whose ranks never stalled
    code, out, _ = _diagnose([str(empty)], capsys)
    assert code == 1 and "no rank stalled with PyTorch's Flight Recorder on" in out
    code, out, _ = _diagnose([str(empty), "--role", "policy"], capsys)
    assert code == 1 and "the run has no role 'policy' (its ranks have none): leave out --role" in out, out
    roles = tmp_path / "roles"  # a single-controller run whose ranks all have roles, none stalled
    roles.mkdir()
    for role in ("policy", "generation"):
        RunFiles(roles, role=role).config.write_text("{}")
    code, out, _ = _diagnose([str(roles)], capsys)
    assert code == 1 and "the run's ranks have roles (generation, policy): pass --role generation" in out, out
    code, out, _ = _diagnose([str(roles), "--role", "nosuch"], capsys)
    assert code == 1 and "the run has no role 'nosuch' (generation, policy)" in out, out
    outputs = tmp_path / "runs"  # output_dir, the run directories' parent
    (outputs / "run-a").mkdir(parents=True)
    (outputs / "run-a" / "config.json").write_text("{}")
    code, out, _ = _diagnose([str(outputs)], capsys)
    assert code == 1 and "not a run directory (no config.json); the run directories in it: run-a" in out, out
    (empty / "collectives.rank0.json").write_text('{"rank": 0}')  # a rank stalled; its file is bad
    code, out, err = _diagnose([str(empty)], capsys)
    assert code == 1 and "every one was skipped" in out and "Flight Recorder on" not in out, out
    assert "skipped collectives.rank0.json: no valid written_at" in err


def test_diagnose_without_the_waiting_ranks_summaries_names_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Only the late rank's file is readable: no rank can be named behind, and the output says
    whose summaries are missing rather than that every rank is in the same collective."""
    _write_hang(tmp_path)
    for rank in (0, 2, 3):
        RunFiles(tmp_path, rank).collectives.unlink()
    code, out, _ = _diagnose([str(tmp_path)], capsys)
    assert code == 1 and "no verdict: rank(s) 0, 2, 3 left no readable summary" in out, out


def test_diagnose_with_a_role_over_ranks_without_one_says_to_leave_it_out(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _write_hang(tmp_path)
    code, out, _ = _diagnose([str(tmp_path), "--role", "trainer"], capsys)
    assert code == 1 and "no readable collectives.trainer.rank<k>.json" in out, out
    assert "files of ranks without a role: leave out --role" in out, out


def test_diagnose_says_a_roles_own_files_were_skipped_before_pointing_elsewhere(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--role trainer whose every file is damaged, beside files of ranks without a role: the
    trainer's files were skipped (named on stderr); "leave out --role" would send the user to the
    wrong job's files."""
    _write_hang(tmp_path, role="trainer")
    _write_hang(tmp_path)
    for rank in range(4):
        RunFiles(tmp_path, rank, "trainer").collectives.write_text("{", encoding="utf-8")
    code, out, err = _diagnose([str(tmp_path), "--role", "trainer"], capsys)
    assert code == 1 and "every one was skipped" in out and "leave out --role" not in out, out
    assert "skipped collectives.trainer.rank0.json: unreadable" in err, err


def test_usage_errors_exit_2_and_help_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["diagnose"], ["doctor", "extra"], ["nonsense"]):
        with pytest.raises(SystemExit) as raised:
            main(argv)
        assert raised.value.code == 2, argv
    assert "RUN_DIR" in capsys.readouterr().err
    with pytest.raises(SystemExit) as raised:
        main(["diagnose", "--help"])
    assert raised.value.code == 0 and "--role ROLE" in capsys.readouterr().out
    assert main([]) == 2 and "{doctor,diagnose}" in capsys.readouterr().out
    # `python -m otel_train` is the same command
    proc = subprocess.run([sys.executable, "-m", "otel_train", "--help"], capture_output=True, text=True)
    assert proc.returncode == 0 and "usage: otel-train" in proc.stdout, proc.stderr


def test_doctor_into_a_pipe_closed_early_ends_without_a_traceback(tmp_path: Path) -> None:
    """`otel-train doctor | head -1`: the reader leaves after a line."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "otel_train", "doctor"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stderr is not None
    assert proc.stdout.readline().startswith(b"config:")
    proc.stdout.close()
    proc.wait(timeout=60)
    assert b"Traceback" not in proc.stderr.read()


def test_doctor_fails_on_an_unwritable_output_dir_and_a_busy_pull_port(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        monkeypatch.setenv("OTEL_TRAIN_PROMETHEUS_PORT", str(listener.getsockname()[1]))
        monkeypatch.setenv("OTEL_TRAIN_OUTPUT_DIR", str(blocker / "runs"))
        assert main(["doctor"]) == 1
    out = capsys.readouterr().out
    assert f"output dir: {blocker / 'runs'} NOT writable" in out, out
    assert "BUSY (another job?)" in out
    monkeypatch.setenv("OTEL_TRAIN_PROMETHEUS_PORT", "0")
    monkeypatch.setenv("OTEL_TRAIN_RUN_DIR_ENABLED", "false")  # no run dir: nothing to write
    assert main(["doctor"]) == 0
    assert "output dir: off (run_dir_enabled=False)" in capsys.readouterr().out
    monkeypatch.delenv("OTEL_TRAIN_RUN_DIR_ENABLED")
    monkeypatch.setenv("OTEL_TRAIN_OUTPUT_DIR", str(tmp_path / "runs"))
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    monkeypatch.delenv("OTEL_TRAIN_OTLP_ENDPOINT", raising=False)
    assert main(["doctor"]) == 0
    assert f"output dir: {tmp_path / 'runs'} (created at init())" in capsys.readouterr().out


def test_doctor_never_raises_on_an_unenterable_output_dir_or_an_unresolvable_host(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before Python 3.13 `Path.exists()` raises PermissionError under a directory this user may
    not enter (root runs the suite, so that is simulated); a pull host that does not resolve made
    the port check raise socket.gaierror. Both are a failed check, not a traceback."""

    def no_entry(self: Path, *args: object, **kwargs: object) -> bool:
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "exists", no_entry)
    monkeypatch.setenv("OTEL_TRAIN_OUTPUT_DIR", str(tmp_path / "runs"))
    monkeypatch.setenv("OTEL_TRAIN_PROMETHEUS_PORT", "9464")
    monkeypatch.setenv("OTEL_TRAIN_PROMETHEUS_HOST", "no-such-host.invalid")
    assert main(["doctor"]) == 1
    out = capsys.readouterr().out
    assert f"output dir: {tmp_path / 'runs'} (created at init())" in out, out
    assert "prometheus pull endpoint: no-such-host.invalid:9464 cannot be checked" in out, out
    assert "OTEL_TRAIN_PROMETHEUS_HOST" in out
    monkeypatch.setenv("OTEL_TRAIN_PROMETHEUS_HOST", "a" * 64 + ".example")  # idna: a label > 63
    assert main(["doctor"]) == 1
    assert "cannot be checked" in capsys.readouterr().out


def test_demo_is_refused_with_where_to_run_it_from(tmp_path: Path) -> None:
    """The wheel carries no demo: `otel-train demo` (any flags) exits 2 with one line naming
    `make demo` and `python -m examples.demo`, runs nothing and imports no torch."""
    script = (
        "import sys\nfrom otel_train.cli import main\ncode = main(sys.argv[1:])\n"
        "assert 'torch' not in sys.modules and 'examples' not in sys.modules, 'the demo was imported'\n"
        "raise SystemExit(code)\n"
    )
    for argv in (
        ["demo"],
        ["demo", "--steps", "1", "--output-dir", str(tmp_path / "runs")],
        ["demo", "--help"],
    ):
        proc = subprocess.run(
            [sys.executable, "-c", script, *argv], cwd=tmp_path, capture_output=True, text=True, timeout=120
        )
        assert proc.returncode == 2 and proc.stdout == "", (argv, proc.stdout, proc.stderr)
        err = proc.stderr
        assert err.startswith("otel-train demo: error:") and err.count("\n") == 1, err
        assert "`make demo`" in err and "`python -m examples.demo`" in err, err
    assert not (tmp_path / "runs").exists()


def _doctor_otlp(
    endpoint: str, protocol: str, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> tuple[int, str]:
    monkeypatch.setenv("OTEL_TRAIN_PROMETHEUS_PORT", "0")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", protocol)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "500")  # milliseconds: the export's deadline
    monkeypatch.setattr(cli, "OTLP_PROBE_S", 0.5)  # the connect's
    code = main(["doctor"])
    return code, next(line for line in capsys.readouterr().out.splitlines() if line.startswith("otlp:"))


@pytest.mark.parametrize("protocol", ["http/protobuf", "grpc"])
def test_doctor_calls_reachable_only_an_endpoint_that_takes_an_otlp_export(
    protocol: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with tarpit() as endpoint:  # accepts TCP connections, never answers
        code, line = _doctor_otlp(endpoint, protocol, monkeypatch, capsys)
    assert (
        code == 1
        and "NOT reachable: something accepts TCP connections there but refused or did not take" in line
    ), line
    assert "OTEL_EXPORTER_OTLP_PROTOCOL" in line
    code, line = _doctor_otlp(refused_endpoint(), protocol, monkeypatch, capsys)
    assert (
        code == 1
        and "NOT reachable: the collector is down or unreachable (cannot connect" in line
        and "refused" in line
    ), line
    receiver = http_receiver if protocol == "http/protobuf" else grpc_receiver
    with receiver() as (endpoint, received):
        code, line = _doctor_otlp(endpoint, protocol, monkeypatch, capsys)
    assert code == 0 and "reachable (it accepted an empty OTLP export)" in line, line
    assert len(received.metrics) == 1


def test_doctor_names_an_endpoint_that_drops_connection_attempts(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A listener whose accept queue is full: Linux drops further SYNs, as a firewall would."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        address = listener.getsockname()
        fillers = [socket.socket() for _ in range(4)]
        for filler in fillers:
            filler.setblocking(False)
            filler.connect_ex(address)
        try:
            try:
                socket.create_connection(address, timeout=0.5).close()
                pytest.skip("this kernel answers a full accept queue (tcp_abort_on_overflow?)")
            except TimeoutError:
                pass
            code, line = _doctor_otlp(f"http://127.0.0.1:{address[1]}", "http/protobuf", monkeypatch, capsys)
        finally:
            for filler in fillers:
                filler.close()
    assert code == 1 and "NOT reachable: no answer to a TCP connect within 0.5 s" in line, line


def test_a_frozen_rank_is_named_with_its_host_from_the_launch_facts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A dead or frozen rank writes no summary: its host comes from env.json, where rank 0 wrote
    every rank's placement at init."""
    from otel_train.diagnostics import attribute, read_summaries, with_launch_hosts

    _write_hang(tmp_path)
    RunFiles(tmp_path, 1).collectives.unlink()
    code, out, _ = _diagnose([str(tmp_path)], capsys)
    assert code == 0 and "rank 1 left no readable Flight Recorder summary" in out, out
    launch = {"ranks": [{"rank": r, "host": "hostB" if r == 1 else "vm"} for r in range(4)]}
    RunFiles(tmp_path).env.write_text(json.dumps({"host": "vm", "launch": launch}))
    code, out, _ = _diagnose([str(tmp_path)], capsys)
    assert code == 0 and "rank 1 (hostB) left no readable Flight Recorder summary" in out, out
    summaries = read_summaries(tmp_path)
    [verdict] = attribute(summaries, 4)
    assert verdict.attributes(with_launch_hosts(summaries, tmp_path))["missing_hosts"] == "hostB"
    RunFiles(tmp_path).env.write_text("{not json")  # a damaged file: the summaries' hosts alone
    assert with_launch_hosts(summaries, tmp_path) == summaries


@pytest.mark.parametrize("protocol", ["http/protobuf", "grpc"])
def test_doctor_probes_each_signals_own_endpoint(
    protocol: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Spans to their own collector (a Tempo), logs to a down one, metrics to a third: each URL is
    probed with its signal's exporter, and the dead one is named with the variable to fix."""
    monkeypatch.setenv("OTEL_TRAIN_OUTPUT_DIR", str(tmp_path / "runs"))
    monkeypatch.setenv("OTEL_TRAIN_PROMETHEUS_PORT", "0")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", protocol)
    receiver = http_receiver if protocol == "http/protobuf" else grpc_receiver
    down = refused_endpoint()
    with receiver() as (metrics_url, metrics), receiver() as (traces_url, traces):
        own = "/v1/traces" if protocol == "http/protobuf" else ""
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", metrics_url)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", traces_url + own)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_LOGS_ENDPOINT", down)
        assert main(["doctor"]) == 1
        out = capsys.readouterr().out
        assert len(metrics.metrics) == 1 and not metrics.traces and not metrics.logs
        assert len(traces.traces) == 1 and not traces.metrics
    assert f"otlp: {metrics_url} ({protocol}) reachable" in out, out
    assert f"otlp traces: {traces_url + own} ({protocol}) reachable" in out, out
    assert f"otlp logs: {down} ({protocol}) NOT reachable" in out, out
    assert "Fix OTEL_EXPORTER_OTLP_LOGS_ENDPOINT" in out, out
    # spans alone, to their own URL: probed (no metrics line)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT")
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_LOGS_ENDPOINT")
    main(["doctor"])
    out = capsys.readouterr().out
    assert f"otlp traces: {traces_url + own} ({protocol}) NOT reachable" in out and "otlp:" not in out, out
