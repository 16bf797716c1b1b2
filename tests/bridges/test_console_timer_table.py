"""The console's end-of-run timer table: `% time` is each timer's share of the wall time since
init, so a timer outside steps (an eval loop between them) is measured against the same clock as
the steps, never against the step time it does not belong to."""

from __future__ import annotations

import re
import time

import otel_train as ot


def _shares(out: str) -> dict[str, float]:
    return {m[1]: float(m[2]) for m in re.finditer(r"^(\w+) .* (\d+\.\d)%$", out, re.MULTILINE)}


def test_a_timer_outside_steps_gets_a_share_of_the_wall_time(capsys) -> None:
    ot.init(prometheus_port=0, verbosity=1, progress_bar=False, log_interval=5, run_dir_enabled=False,
            hardware=False)  # fmt: skip
    for i in range(10):
        with ot.step(i), ot.timer("forward"):
            pass
        if i % 5 == 4:
            with ot.timer("eval"):  # between steps: far longer than the steps themselves
                time.sleep(0.05)
    ot.shutdown()
    out = capsys.readouterr().out
    shares = _shares(out)
    assert set(shares) == {"step", "forward", "eval"}, out
    # step and eval never overlap: together they cover at most the wall time
    assert shares["step"] + shares["eval"] <= 100.0, out
    assert shares["forward"] <= shares["step"], out  # nested: a part of the step's share
    assert "of the " in out and "since init; a timer inside another counts in both" in out


def test_the_console_says_where_the_run_is_and_when_losses_were_nan(capsys, tmp_path) -> None:
    """The run directory at the start and the end; a flush whose interval had NaN losses says how
    many next to the loss (the finite values' mean), or in its place when none was finite."""
    ot.init(prometheus_port=0, verbosity=1, progress_bar=False, log_interval=10, hardware=False,
            output_dir=str(tmp_path), run_name="nan")  # fmt: skip
    for i in range(30):
        with ot.step(i):
            ot.record("loss", float("nan") if i >= 12 else 1.0)
    ot.shutdown()
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert (
        lines[0] == f"otel_train: writing to {tmp_path / 'nan'}" and f"run dir: {tmp_path / 'nan'}" in lines
    )
    assert "step 10 | loss 1.0000 | step" in out
    assert "step 20 | loss 1.0000 (+8 NaN/Inf) | step" in out
    assert "step 30 | loss 10 NaN/Inf | step" in out, out
