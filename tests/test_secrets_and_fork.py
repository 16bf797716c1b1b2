"""Secrets never leave; forked DataLoader workers never export."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from helpers.otlp_receiver import http_receiver
from torch.utils.data import DataLoader, Dataset

import otel_train as ot
from otel_train import semconv
from otel_train.testing import current_session

MARKERS = ("MARKER-ENV-7f3a", "MARKER-FIELD-19cd", "MARKER-HEADER-55be", "MARKER-HPARAM-a0a0")


def test_secrets_never_reach_files_console_or_payloads(tmp_path, monkeypatch, capfd) -> None:
    env_marker, field_marker, header_marker, hparam_marker = MARKERS
    monkeypatch.setenv("WANDB_API_KEY", env_marker)
    monkeypatch.setenv("MY_SERVICE_TOKEN", env_marker)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", f"authorization=Bearer {header_marker}")
    with http_receiver() as (endpoint, received):
        ot.init(
            otlp_endpoint=endpoint,
            output_dir=str(tmp_path),
            prometheus_port=0,
            verbosity=2,
            log_interval=2,
            resource_attributes={"team": "ml", "api_token": field_marker},
        )
        session = current_session()
        look_alike = {"max_new_tokens": 512, "num_key_value_heads": 8, "tokenizer_name": "gpt2"}
        ot.log_hyperparams(
            {"lr": 1e-3, "api_key": hparam_marker, "nested": {"password": hparam_marker}, **look_alike}
        )
        for i in range(4):
            with ot.step(i):
                ot.record("loss", 1.0)
        ot.shutdown()
    out, err = capfd.readouterr()
    files = [p for p in Path(session.run_dir).rglob("*") if p.is_file()]
    assert {p.name for p in files} >= {"config.json", "env.json", "metrics.rank0.jsonl", "hparams.json"}
    for marker in MARKERS:
        assert marker not in out and marker not in err, marker
        for path in files:
            assert marker.encode() not in path.read_bytes(), (marker, path)
        for body in received.raw:
            assert marker.encode() not in body, marker
    # names that only look like secrets keep their values (hyperparameters of every LLM config)
    hparams = json.loads((Path(session.run_dir) / "hparams.json").read_text())
    assert {k: hparams[k] for k in look_alike} == look_alike
    # the header was used for what it is for: authenticating the export
    assert any(h.get("authorization") == f"Bearer {header_marker}" for h in received.headers)
    assert received.metrics and received.raw


class _Tokens(Dataset):
    def __len__(self) -> int:
        return 32

    def __getitem__(self, index: int) -> torch.Tensor:
        # Worker processes call the API too; in a forked child it must be a no-op.
        with ot.timer("worker_side"):
            ot.record("worker_value", float(index))
        return torch.full((4,), index)


def test_forked_dataloader_workers_export_nothing() -> None:
    with http_receiver(record_senders=True) as (endpoint, received):
        ot.init(
            otlp_endpoint=endpoint,
            prometheus_port=0,
            verbosity=0,
            log_interval=2,
            metric_export_interval_s=0.2,
            run_dir_enabled=False,
        )
        loader = DataLoader(_Tokens(), batch_size=4, num_workers=2, multiprocessing_context="fork")
        steps = 0
        for _epoch in range(2):
            for batch in loader:
                with ot.step(tokens=int(batch.numel()), samples=batch.shape[0]):
                    time.sleep(0.06)  # give the children's restarted SDK threads time to tick
                steps += 1
        time.sleep(0.5)
        ot.shutdown()
    # every request came from this process, none from a worker (whose inherited Resource would
    # look like the parent's): the receiver asks the kernel who holds each client socket. A worker
    # forked while the exporter's keep-alive connection was open holds that socket too, so a
    # request may list it beside us; a connection a worker opened itself would list only workers.
    assert received.sender_pids, "no request recorded its sender"
    assert all(os.getpid() in holders for holders in received.sender_pids), received.sender_pids
    points = received.metric_points()
    # A child re-exporting the parent's frozen cumulative values would show up as a decrease.
    exported = [
        dp.as_int or dp.as_double
        for _, metric, _ in points[semconv.STEPS.name]
        for dp in metric.sum.data_points
    ]
    assert len(exported) >= 3
    assert exported == sorted(exported), exported
    last_steps = points[semconv.STEPS.name][-1][1].sum.data_points[0]
    assert (last_steps.as_int or last_steps.as_double) == steps == 16
    last_tokens = points[semconv.TOKENS.name][-1][1].sum.data_points[0]
    assert (last_tokens.as_int or last_tokens.as_double) == 16 * 16
    assert semconv.instrument_name_for("worker_value") not in points  # workers' records went nowhere


FORK_EXIT_SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    import otel_train as ot

    out, how = sys.argv[1], sys.argv[2]
    with ot.init(output_dir=out, run_name="r", prometheus_port=0, log_interval=2, stall_timeout_s=1.0) as run:
        for step in range(12):  # long enough for the watchdog to arm its faulthandler backstop
            with ot.step(step):
                time.sleep(0.1)
        pid = os.fork()
        if pid == 0:  # leaves the `with` block: Run.__exit__, atexit, the interpreter's finalization
            if how == "raise":
                raise RuntimeError("the child fails")
            sys.exit(0)
        deadline = time.monotonic() + 30
        while not os.waitpid(pid, os.WNOHANG)[0]:
            if time.monotonic() > deadline:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                print("child hung", flush=True)
                break
            time.sleep(0.05)
        progress = (run.run_dir / "progress.txt").read_text()
        print("ends before the parent's", progress.count("end of process"), flush=True)
        with ot.step(12):
            pass
    """
)


@pytest.mark.parametrize("how", ["exit", "raise"])
def test_forked_child_leaving_the_run_block_leaves_the_parents_session_alone(tmp_path, how) -> None:
    # The child inherits the `with ot.init() as run:` block, not the session's threads: its way out
    # must neither shut the parent's session down (a second end-of-process line, the parent's
    # summary printed) nor wait for the parent's faulthandler timer thread (forever, GIL held).
    proc = subprocess.run(
        [sys.executable, "-c", FORK_EXIT_SCRIPT, str(tmp_path), how],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "child hung" not in proc.stdout, proc.stdout
    assert "ends before the parent's 0" in proc.stdout, proc.stdout
    progress = (tmp_path / "r" / "progress.txt").read_text()
    assert progress.count("end of process") == 1, progress
    rows = (tmp_path / "r" / "metrics.rank0.jsonl").read_text().splitlines()
    assert json.loads(rows[-1])["step"] == 12  # the parent kept recording after the child left
