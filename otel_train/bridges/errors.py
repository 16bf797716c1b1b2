"""The errors a bridge raises while it starts, and the checks behind them. The bridge
process (`bridges/process`) reports either by name to the training process, where `init()` turns it
into a `ConfigError` naming the extra to install or the path to fix."""

from __future__ import annotations

import importlib.util
import os
import tempfile


class BridgeImportError(ImportError):
    """The backend package of a bridge is not installed. The message names the extra to install."""

    def __init__(
        self, backend: str, extra: str, cause: BaseException | None = None, needs: str | None = None
    ) -> None:
        detail = f" ({type(cause).__name__}: {cause})" if cause is not None else ""
        if needs is not None:  # a package the extra does not install
            message = f"the {backend} bridge needs {needs}, which is not installed. Install it, or turn the bridge off."
        else:
            message = (
                f"the {backend} bridge needs the {extra!r} package, which could not be imported{detail}. "
                f"Install it with: pip install 'otel-train[{extra}]', or turn the bridge off."
            )
        super().__init__(message)


def require_packages(backend: str, extra: str, *modules: str) -> None:
    """BridgeImportError unless every module of `modules` is found. Only looked for (cheap, so
    init() stays fast): the bridge imports its backend at its first write, on its own thread."""
    for module in modules:
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError) as exc:  # a parent package missing, or blocked
            raise BridgeImportError(backend, extra, exc) from exc
        if not found:
            raise BridgeImportError(backend, extra)


class BridgeSetupError(RuntimeError):
    """A bridge cannot start: for example its log directory cannot be created or written."""


def ensure_writable_dir(path: str | os.PathLike[str], backend: str) -> None:
    """Create `path` and prove it writable (BridgeSetupError otherwise) with a real write, not
    permission bits: that also catches read-only file systems and runs as root."""
    path = os.fspath(path)
    try:
        os.makedirs(path, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".otel-train-probe-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise BridgeSetupError(
            f"the {backend} bridge cannot write to its directory {path!r}: "
            f"{exc.strerror or exc} ({type(exc).__name__}). "
            "Point output_dir at a writable location, or turn the bridge off."
        ) from exc


class BridgeSetupFailed(RuntimeError):
    """The bridge process could not build a bridge; the message is the bridge's own."""


class BridgeDisabled(RuntimeError):
    """A backend is off for the rest of the run: retrying cannot help (W&B could start neither
    online nor offline). `ThreadedSink` logs its message once and drops, counted, what follows."""
