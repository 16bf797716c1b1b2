"""Reusing a run name never appends silently: another run's files are a ConfigError at init();
the same run restarted (same run_id: torchrun elastic restart, SLURM requeue) resumes and says so;
the ranks of one job share the directory."""

from __future__ import annotations

import json

import pytest

import otel_train as ot
from otel_train.config import ConfigError
from otel_train.testing import current_session


def _run(tmp_path, steps: int, **settings) -> ot.Session:
    ot.init(output_dir=str(tmp_path), run_name="exp", prometheus_port=0, verbosity=0, log_interval=1,
                      hardware=False, **settings)  # fmt: skip
    session = current_session()
    for step in range(steps):
        with ot.step(step):
            ot.record("loss", 1.0)
    ot.shutdown()
    return session


def test_another_run_with_the_same_name_is_refused(tmp_path) -> None:
    first = _run(tmp_path, 3)
    metrics = first.run_dir / "metrics.rank0.jsonl"
    before = metrics.read_bytes()
    config_before = (first.run_dir / "config.json").read_bytes()
    with pytest.raises(ConfigError) as info:
        _run(tmp_path, 3)
    message = str(info.value)
    assert "run_name 'exp'" in message and "OTEL_TRAIN_RUN_NAME" in message and "run_id" in message
    assert metrics.read_bytes() == before  # nothing appended
    assert (first.run_dir / "config.json").read_bytes() == config_before  # nor overwritten


def test_same_run_id_resumes_and_marks_the_restart(tmp_path) -> None:
    first = _run(tmp_path, 3, run_id="job-42")
    second = _run(tmp_path, 2, run_id="job-42")
    assert second.run_dir == first.run_dir  # resumed: the restart event below
    rows = [json.loads(line) for line in (first.run_dir / "metrics.rank0.jsonl").read_text().splitlines()]
    assert sum(r.get("train/steps", 0) for r in rows) == 5
    events = [json.loads(line) for line in (first.run_dir / "events.rank0.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events].count("restart") == 1


def test_ranks_of_one_job_share_the_directory(tmp_path) -> None:
    from otel_train.run_directory import claim_run_dir

    run_dir = tmp_path / "exp"
    run_dir.mkdir()
    # rank 0 got there first: it claimed its files and wrote config.json
    assert claim_run_dir(run_dir, 0, "job-7", "exp") is False
    (run_dir / "config.json").write_text("{}")
    (run_dir / "metrics.rank0.jsonl").write_text('{"step": 0}\n')
    assert claim_run_dir(run_dir, 1, "job-7", "exp") is False  # rank 1: a fresh start, not a reuse
    # an elastic restart of the same job: both ranks resume
    assert claim_run_dir(run_dir, 0, "job-7", "exp") is True
    assert claim_run_dir(run_dir, 1, "job-7", "exp") is True
    # another job reusing the name: refused on every rank that has files there
    with pytest.raises(ConfigError):
        claim_run_dir(run_dir, 1, "job-8", "exp")
    # files from before owner files existed: cannot tell whose, so not appended to
    legacy = tmp_path / "old"
    legacy.mkdir()
    (legacy / "metrics.rank0.jsonl").write_text('{"step": 0}\n')
    with pytest.raises(ConfigError):
        claim_run_dir(legacy, 0, "job-9", "old")
