"""Weights & Biases bridge: one `run.log` per flush on the training step's axis, `wandb.init`
lazily on the bridge's thread. Design: docs/design/bridges.md#wandb.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

from otel_train import semconv as sc
from otel_train.bridges.base import Sink, histogram_bins, merge_params
from otel_train.bridges.errors import (
    BridgeDisabled,
    BridgeImportError,
    ensure_writable_dir,
    require_packages,
)
from otel_train.run_directory import RunFiles

logger = logging.getLogger("otel_train")

STEP_KEY = sc.CURRENT_STEP.key  # "train/step": the x axis of every series
TRANSACTION_LOG_FLUSH_S = 1.0  # W&B's default is 15 s (`_settings`)
FINISH_TIMEOUT_S = 10.0  # run.finish() may hang on an upload (wandb/wandb#5601): then it is left
TEARDOWN_TIMEOUT_S = 10.0  # wandb.teardown() after a failed init waits for wandb-core to exit


def has_wandb_credentials(environ: Mapping[str, str] | None = None) -> bool:
    """True if W&B could log in without a prompt: WANDB_API_KEY, or a netrc entry for the W&B host."""
    import netrc
    from urllib.parse import urlparse

    environ = os.environ if environ is None else environ
    if environ.get("WANDB_API_KEY", "").strip():
        return True
    host = urlparse(environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname or "api.wandb.ai"
    path = environ.get("NETRC") or os.path.join(os.path.expanduser("~"), ".netrc")
    try:
        auth = netrc.netrc(path).authenticators(host)
    except (OSError, netrc.NetrcParseError):
        return False
    return bool(auth and auth[2])


def resolve_mode(mode: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The `mode` passed to `wandb.init`. None lets an explicit WANDB_MODE decide ("auto" only)."""
    environ = os.environ if environ is None else environ
    if mode != "auto":
        return mode
    if environ.get("WANDB_MODE", "").strip():
        return None
    return "online" if has_wandb_credentials(environ) else "offline"


def warn_if_user_run_active() -> None:
    """In the training process, at init: warn that a user's active W&B run is not the bridge's.
    Never imports wandb."""
    wandb = sys.modules.get("wandb")
    run = getattr(wandb, "run", None) if wandb is not None else None
    if run is None:
        return
    logger.warning(
        "otel_train: a W&B run is active in this process (%s); otel_train's W&B bridge logs to its "
        "own run (in the bridge process), not into yours. Pass wandb=False to keep only yours.",
        getattr(run, "id", "?"),
    )


WANDB_ID_MAX = 64  # why 64, and the id scheme: docs/design/bridges.md#wandb
_NOT_IN_ID = re.compile(r"[^A-Za-z0-9_-]")


def _wandb_id(run_id: str, role: str = "", rank: int | None = None) -> str:
    """The W&B run id of `run_id` (ending in `-<role>` with a role), `-rank<k>` appended for a rank's
    own run: kept when W&B takes it as it is, else mapped, with 8 hex of its SHA-1 (never colliding)."""
    import hashlib

    tail = f"-rank{rank}" if rank is not None else ""
    whole = f"{run_id}{tail}"
    if not _NOT_IN_ID.search(whole) and len(whole) <= WANDB_ID_MAX:
        return whole
    if role and run_id.endswith(f"-{role}"):
        run_id, tail = run_id[: -len(role) - 1], f"-{role}{tail}"
    digest = hashlib.sha1(whole.encode("utf-8"), usedforsecurity=False).hexdigest()[:8]
    tail = _NOT_IN_ID.sub("-", tail)[: WANDB_ID_MAX - len(digest) - 2]
    head = _NOT_IN_ID.sub("-", run_id)[: WANDB_ID_MAX - len(digest) - 1 - len(tail)].rstrip("-")
    return f"{head}-{digest}{tail}"


def _why(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _release_failed_init(wandb: Any) -> None:
    """Stop W&B's service after a `wandb.init` that raised, so the next init can use the run id.

    A failed init leaves its run's stream registered in wandb-core under the run id, and a second
    init of that id is refused ("run ID <id> is in use", core/internal/stream/stream_mux.go,
    AddStream). Closing that one stream (`inform_finish`) blocks wandb-core until an exit record
    that never comes (stream.go, Stream.Close), so the whole service is torn down instead: the
    only run in the bridge process is this bridge's. `wandb.teardown` forgets the service before it
    waits for it to exit, so even when that wait is cut short here the next init starts a fresh
    one."""

    def teardown() -> None:
        try:
            wandb.teardown()
        except Exception as exc:  # wandb's service teardown: the next init starts a new service anyway
            logger.debug("otel_train: wandb.teardown after a failed init: %r", exc)

    thread = threading.Thread(target=teardown, name="otel-train-wandb-teardown", daemon=True)
    thread.start()
    thread.join(TEARDOWN_TIMEOUT_S)


class WandbSink(Sink):
    """Logs one W&B run (per rank when `rank` is given) into `<wandb_dir or run_dir>/wandb/`."""

    name = "wandb"

    def __init__(
        self,
        run_dir: Path | str,
        config_dict: Mapping[str, Any],
        project: str,
        entity: str | None = None,
        group: str | None = None,
        tags: Sequence[str] = (),
        mode: str = "auto",
        run_name: str | None = None,
        run_id: str | None = None,
        rank: int | None = None,
        role: str = "",
        wandb_dir: Path | str | None = None,
        resume: str = "allow",
    ) -> None:
        require_packages("W&B", "wandb", "wandb")
        self.run_dir = Path(run_dir)  # wandb_run.json's
        ensure_writable_dir(self.run_dir, "W&B")
        self.wandb_dir = Path(wandb_dir) if wandb_dir else self.run_dir  # WANDB_DIR: where W&B writes
        if self.wandb_dir != self.run_dir:
            ensure_writable_dir(self.wandb_dir, "W&B")
        self.resume = resume
        self.config = dict(config_dict)
        self.project = project
        self.entity = entity
        self.tags = list(tags)
        self.mode = mode
        self.role = role  # names this role's wandb_run file (each role of a run has its own W&B run)
        # rank=None: the one run of the job. rank=N (bridge_all_ranks): one run per rank, grouped.
        suffix = f"-rank{rank}" if rank is not None else ""
        self.run_name = f"{run_name}{suffix}" if run_name else None
        self.run_id = _wandb_id(run_id, role, rank) if run_id else None
        self.group = group or (run_name if rank is not None else None)
        self._run: Any = None
        self._off: str | None = None  # why this bridge is off, once W&B could not start at all
        self._closed = False

    def _ensure_run(self) -> Any:
        if self._run is not None:
            return self._run
        if self._off is not None:
            raise BridgeDisabled(self._off)  # W&B could not start (_turn_off): no second try
        try:
            import wandb
        except ImportError as exc:
            raise BridgeImportError("W&B", "wandb", exc) from exc
        # This runs in the bridge process, where no user code ran: wandb.run is never the user's.
        mode = resolve_mode(self.mode)
        failed_online: Exception | None = None
        try:
            self._run = self._init(wandb, mode)
        except Exception as exc:  # wandb.init (its service, the network)
            self._run = self._init_offline_after(wandb, mode, exc)
            failed_online = exc
        self._run.define_metric(STEP_KEY)
        self._run.define_metric("*", step_metric=STEP_KEY)
        info = self._save_run_info()
        if failed_online is not None:  # said once the offline run works, with how to upload it
            logger.warning(
                "otel_train: wandb.init (online) failed (%s); logging offline instead, as W&B run "
                "%s. Upload it later with: %s",
                _why(failed_online),
                self._run.id,
                info["sync_command"],
            )
        return self._run

    def _init_offline_after(self, wandb: Any, mode: str | None, exc: Exception) -> Any:
        """The offline run that replaces an online init that raised `exc` ("auto" mode only).
        Otherwise, or if offline fails too, the bridge is off for the run (BridgeDisabled)."""
        _release_failed_init(wandb)
        if self.mode != "auto" or mode != "online":
            self._turn_off(f"wandb.init ({mode or os.environ.get('WANDB_MODE', '')}) failed", exc)
        # wandb/wandb#9865, #7671: an online init that fails must not cost the run its data
        try:
            return self._init(wandb, "offline")
        except Exception as offline_exc:  # wandb.init again (its service, the disk)
            _release_failed_init(wandb)
            self._turn_off(f"wandb.init failed online ({_why(exc)}) and offline", offline_exc)

    def _turn_off(self, what: str, exc: Exception) -> NoReturn:
        """Raise, now and at every later write, that this bridge is off for the run: a retried init
        would wait up to WANDB_INIT_TIMEOUT and leave one more run directory each time."""
        self._off = f"{what} ({_why(exc)}); no W&B run is logged"
        raise BridgeDisabled(self._off) from exc

    def _init(self, wandb: Any, mode: str | None) -> Any:
        return wandb.init(
            project=self.project,
            entity=self.entity,
            name=self.run_name,
            id=self.run_id,
            resume=self.resume if self.run_id else None,
            group=self.group,
            tags=self.tags or None,
            dir=str(self.wandb_dir),
            mode=mode,
            config=self.config,
            settings=self._settings(wandb),
        )

    @staticmethod
    def _settings(wandb: Any) -> Any:
        wanted: dict[str, Any] = {
            "silent": True,
            "console": "off",
            "x_disable_stats": True,  # no second GPU/CPU sampler (wandb/wandb#8359)
            "x_disable_meta": True,  # no argv/env/host capture (secrets, failure-modes §5.4)
            "x_disable_machine_info": True,
            "disable_git": True,  # git remotes can hold credentials
            "save_code": False,
            "disable_code": True,
            "x_save_requirements": False,
            "disable_job_creation": True,
            "x_transaction_log_flush_interval": TRANSACTION_LOG_FLUSH_S,  # design page, #wandb
        }
        fields = getattr(wandb.Settings, "model_fields", None)
        if fields is not None:
            wanted = {k: v for k, v in wanted.items() if k in fields}
        return wandb.Settings(**wanted)

    def _save_run_info(self) -> dict[str, Any]:
        """Write `wandb_run.json` (best effort) and return what it holds."""
        run = self._run
        # WANDB_MODE=disabled (or wandb_mode): a no-op run, with a made-up id, entity "dummy" and a
        # directory that is never written. Nothing was logged, so no id and no directory is named.
        disabled = bool(getattr(run, "disabled", False))
        offline = bool(getattr(run, "offline", False)) and not disabled
        files_dir = None if disabled else getattr(run, "dir", None)  # <dir>/wandb/<offline-run-...>/files
        local = Path(files_dir).resolve().parent if files_dir else None
        # Each process of a restarted run writes its own offline directory of the one W&B run id;
        # `wandb sync` merges those it is given, in order: all of them, oldest first (named by time).
        dirs = sorted(local.parent.glob(f"offline-run-*-{run.id}")) if local and offline else []
        if local is not None and offline and local not in dirs:
            dirs.append(local)
        info = {
            **{
                key: None if disabled else getattr(run, key, None)
                for key in ("id", "name", "project", "entity")
            },
            "group": self.group,
            # run.url warns on stdout offline
            "url": None if offline or disabled else getattr(run, "url", None),
            "mode": "disabled" if disabled else "offline" if offline else "online",
            "offline": offline,
            "dir": str(local) if local else None,
            "dirs": [str(path) for path in dirs],
            "sync_command": "wandb sync " + " ".join(shlex.quote(str(path)) for path in dirs)
            if dirs
            else None,
        }
        path = RunFiles(self.run_dir, role=self.role).wandb_run_info
        try:
            path.write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
        except OSError as exc:
            logger.debug("otel_train: could not write %s: %s", path, exc)
        return info

    def write_scalars(self, step: int, wall_time: float, scalars: Mapping[str, float]) -> None:
        self._ensure_run().log({**{key: float(value) for key, value in scalars.items()}, STEP_KEY: step})

    def write_text(self, key: str, text: str, step: int) -> None:
        import wandb

        run = self._ensure_run()
        run.log({key: wandb.Table(columns=["text"], data=[[text]]), STEP_KEY: step})

    def write_samples(self, key: str, rows: Sequence[tuple[str, str]], step: int) -> None:
        import wandb

        run = self._ensure_run()
        table = wandb.Table(columns=["prompt", "output"], data=[[str(p), str(o)] for p, o in rows])
        run.log({key: table, STEP_KEY: step})

    def write_histogram(self, key: str, values: Sequence[float], step: int) -> None:
        import wandb

        binned = histogram_bins(values)  # wandb.Histogram(values) raises on a range it cannot bin
        if binned is None:
            return
        _, counts, edges = binned
        run = self._ensure_run()
        run.log({key: wandb.Histogram(np_histogram=(counts, edges)), STEP_KEY: step})

    def write_hparams(self, params: Mapping[str, Any]) -> None:
        run = self._ensure_run()
        # config.update replaces a top-level key whole: merge nested ones with what the run has,
        # so {"optim": {"lr": 2e-3}} after {"optim": {"lr": 1e-3, "betas": [...]}} keeps "betas".
        held = {key: run.config[key] for key in params if key in run.config}
        run.config.update(merge_params(held, params), allow_val_change=True)

    def close(self, final_scalars: Mapping[str, float], failed: bool = False) -> None:
        if self._closed:
            return
        self._closed = True
        run = self._run
        if run is None:
            return  # never initialised: nothing was written, do not create an empty run now
        for key, value in final_scalars.items():
            run.summary[key] = float(value)
        errors: list[BaseException] = []

        def finish() -> None:
            try:
                run.finish(exit_code=1 if failed else 0)  # 1: W&B shows the run as failed
            except BaseException as exc:
                errors.append(exc)

        thread = threading.Thread(target=finish, name="otel-train-wandb-finish", daemon=True)
        thread.start()
        thread.join(FINISH_TIMEOUT_S)
        if thread.is_alive():
            logger.warning(
                "otel_train: wandb finish did not complete within %.1f s; leaving it. "
                "The local copy is in %s (upload it later with `wandb sync`).",
                FINISH_TIMEOUT_S,
                self.wandb_dir / "wandb",
            )
        elif errors:
            raise errors[0]
