"""Length-prefixed pickle frames over a pipe between the training process and the bridge process.
Payloads are plain Python only (str, int, float, bool, None, lists, tuples, dicts), never tensors or
user objects, so the bridge process never imports the user's code: `plain()` makes them so.
"""

from __future__ import annotations

import os
import pickle
import select
import struct
import time
from collections.abc import Mapping
from typing import Any

_LENGTH = struct.Struct("<I")
MAX_FRAME = 256 * 1024 * 1024


class FrameTooLarge(ValueError):
    """A message whose frame would be larger than MAX_FRAME: never sent (the reader refuses it)."""


class BadFrame(ValueError):
    """A frame that arrived whole but cannot be read (over MAX_FRAME, or a pickle that does not
    load): its bytes are consumed, so the next frame reads normally."""


class FrameCut(OSError):
    """A write that failed after part of the frame went into the pipe: the reader may have read
    that part, and died of it (so the frame is not sent to its successor)."""


def encode(message: Any) -> bytes:
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    if len(body) > MAX_FRAME:
        raise FrameTooLarge(f"{len(body)} bytes, over the bridge frame limit of {MAX_FRAME}")
    return _LENGTH.pack(len(body)) + body


def write_frame(fd: int, frame: bytes) -> None:
    view = memoryview(frame)
    while view:
        try:
            written = os.write(fd, view)
        except OSError as exc:
            if len(view) < len(frame):
                raise FrameCut(exc.errno, exc.strerror) from exc
            raise
        view = view[written:]


def _read_exact(fd: int, size: int, deadline: float | None, keep: bool = True) -> bytes | None:
    """`size` bytes from `fd` (b"" when not `keep`: read and let go), or None on EOF;
    TimeoutError past `deadline` (monotonic)."""
    chunks: list[bytes] = []
    left = size
    while left:
        if deadline is not None:
            wait = deadline - time.monotonic()
            if wait <= 0 or not select.select([fd], [], [], wait)[0]:
                raise TimeoutError
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            return None
        if keep:
            chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def read_frame(fd: int, deadline: float | None = None) -> Any:
    """The next message from `fd`; EOFError at end of stream, TimeoutError past `deadline`,
    BadFrame for a whole frame that cannot be read (the stream stays at a frame boundary)."""
    header = _read_exact(fd, _LENGTH.size, deadline)
    if header is None:
        raise EOFError
    (size,) = _LENGTH.unpack(header)
    body = _read_exact(fd, size, deadline, keep=size <= MAX_FRAME)
    if body is None:
        raise EOFError
    if size > MAX_FRAME:
        raise BadFrame(f"a bridge frame of {size} bytes, over the limit of {MAX_FRAME}")
    try:
        return pickle.loads(body)
    except Exception as exc:  # a truncated pickle raises EOFError too: never read as the pipe's end
        raise BadFrame(f"a bridge frame that cannot be unpickled: {exc!r}") from exc


def plain(value: Any, depth: int = 0) -> Any:
    """`value` as plain Python data (for hyperparameters: anything else becomes its str)."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    if depth > 8:
        return str(value)
    if isinstance(value, Mapping):
        return {str(k): plain(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v, depth + 1) for v in value]
    if hasattr(value, "item") and getattr(value, "ndim", None) == 0:  # numpy / 0-dim tensor scalars
        try:
            return plain(value.item(), depth + 1)
        except (RuntimeError, TypeError, ValueError):  # a tensor or array that has no Python scalar
            return str(value)
    return str(value)
