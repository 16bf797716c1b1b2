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


def encode(message: Any) -> bytes:
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _LENGTH.pack(len(body)) + body


def write_frame(fd: int, frame: bytes) -> None:
    view = memoryview(frame)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def _read_exact(fd: int, size: int, deadline: float | None) -> bytes | None:
    """`size` bytes from `fd`, or None on EOF; TimeoutError past `deadline` (monotonic)."""
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
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def read_frame(fd: int, deadline: float | None = None) -> Any:
    """The next message from `fd`; EOFError at end of stream, TimeoutError past `deadline`."""
    header = _read_exact(fd, _LENGTH.size, deadline)
    if header is None:
        raise EOFError
    (size,) = _LENGTH.unpack(header)
    if size > MAX_FRAME:
        raise ValueError(f"bridge frame of {size} bytes is larger than {MAX_FRAME}")
    body = _read_exact(fd, size, deadline)
    if body is None:
        raise EOFError
    return pickle.loads(body)


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
