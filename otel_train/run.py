"""Run: what `ot.init()` returns, the running telemetry's small public face.

    with ot.init(run_name="sft") as run:      # shuts down at the end of the block
        print(run.run_dir, run.prometheus_url)

It names the run (id, name, directory, rank, world size, the pull endpoint), profiles a window of
steps (`run.profile(...)`) and ends it; steps, timers and records go through the module functions
(`ot.step`, `ot.timer`, `ot.record`, ...), which find the running session themselves. The
session's internals stay behind `otel_train.testing.current_session()`, for tests and debugging,
not a stable API.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

from otel_train import _runtime
from otel_train.distributed import RunInfo
from otel_train.redaction import redact_url
from otel_train.session import Session


class Run:
    """One running session, as `ot.init()` returns it (a second `init()` returns the same run)."""

    __slots__ = ("_session",)

    def __init__(self, session: Session) -> None:
        self._session = session

    @property
    def run_id(self) -> str:
        return self._session.identity.run_id

    @property
    def run_name(self) -> str:
        return self._session.run_name

    @property
    def run_dir(self) -> Path | None:
        """This run's directory (None when `run_dir_enabled=False`)."""
        return self._session.run_dir

    @property
    def rank(self) -> int:
        return self._session.identity.rank

    @property
    def world_size(self) -> int:
        return self._session.identity.world_size

    @property
    def prometheus_url(self) -> str | None:
        """The local `/metrics` URL, or None when the pull endpoint is off or its port was taken."""
        return self._session.prometheus_url

    def info(self) -> RunInfo:
        """Everything `ot.run_info()` says, for this run (the last step as of now)."""
        session = self._session
        ident, config = session.identity, session.config
        return RunInfo(
            run_id=ident.run_id,
            run_name=session.run_name,
            run_dir=str(session.run_dir) if session.run_dir is not None else None,
            rank=ident.rank,
            local_rank=ident.local_rank,
            world_size=ident.world_size,
            step=session.step_index,
            role=ident.role,
            output_dir=config.output_dir,
            service_name=config.service_name,
            otlp_endpoint=redact_url(config.otlp_endpoint),  # user:password@ -> ***@
            otlp_metrics_endpoint=redact_url(config.otlp_metrics_endpoint),
            timing_log_level=config.timing_log_level,
            open_step=session.running_step,
            bridges=tuple(
                name
                for name, on in (
                    ("tensorboard", config.tensorboard),
                    ("wandb", config.wandb),
                    ("mlflow", config.mlflow),
                )
                if on
            ),
            rank_series=session.telemetry.rank_series,
        )

    def profile(
        self,
        wait: int = 0,
        warmup: int = 1,
        active: int = 3,
        repeat: int = 1,
        skip_first: int = 0,
        ranks: Sequence[int] | None = None,
    ) -> bool:
        """Profile upcoming steps with torch.profiler: counting from the next step, skip
        `skip_first`, then `repeat` cycles of `wait` idle, `warmup` and `active` recorded steps.
        Chrome traces go to `<run dir>/profiles/rank<k>/`; profiled steps are traced and counted
        (`train.profiler.steps`). Call it any time on the training thread (for example when a
        condition arises; `ot.init()` returns the running run) on the ranks you name (default:
        every rank). Returns True when a window started on this rank. Raises ValueError beyond the
        caps: `active` <= 50, `repeat * active` <= 100, the whole window <= 100,000 steps."""
        from otel_train.profiling import ProfileWindow

        window = ProfileWindow(wait, warmup, active, repeat, skip_first)  # raises on bad arguments
        if _runtime.current() is not self._session:  # shut down (or replaced): nothing to profile
            return False
        return self._session.start_profile(window, ranks)

    def shutdown(self) -> None:
        """`ot.shutdown()` for this run: final flush, exporters stopped. Safe to call twice."""
        if _runtime.current() is self._session:
            _runtime.shutdown()
        else:  # already replaced or shut down: idempotent, waits for a shutdown in progress
            self._session.shutdown()

    def __enter__(self) -> Run:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.shutdown()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Run) and other._session is self._session

    def __hash__(self) -> int:
        return id(self._session)

    def __repr__(self) -> str:
        return f"Run(run_name={self.run_name!r}, run_id={self.run_id!r}, rank={self.rank})"
