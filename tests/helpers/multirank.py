"""Spawn real torch.distributed (gloo, CPU) ranks for multi-rank tests.

    results = run_ranks(4, my_target, (arg1, arg2), timeout=60)

Each rank is a new process forked from a ``forkserver`` that imported torch once (a spawned one
would spend seconds importing it), with the test process's environment as it is at the call,
MASTER_ADDR / MASTER_PORT / RANK / WORLD_SIZE / LOCAL_RANK / LOCAL_WORLD_SIZE set and
``torch.distributed.init_process_group("gloo")`` already called; it runs
``target_fn(rank, world_size, *args)`` and its (picklable) return value comes back through a
multiprocessing queue. ``run_ranks`` returns the values ordered by rank, raises
``RankError`` carrying the child traceback when a rank raised, and ``TimeoutError`` (after killing
every child) when the ranks have not all answered within ``timeout`` seconds.

``target_fn`` must be importable by the children (a module-level function of a test module or of
an importable module): it is pickled by qualified name.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_mod
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from helpers.ports import free_port

# `env` for ranks that run as torch does unasked: neither variable set, so its Flight Recorder is on
# (an empty value would hang torch's init: None unsets).
DEFAULT_FR: dict[str, str | None] = {"TORCH_FR_BUFFER_SIZE": None, "TORCH_NCCL_TRACE_BUFFER_SIZE": None}


class RankError(RuntimeError):
    """A rank raised; the message holds its traceback."""


def _child(
    rank: int,
    world_size: int,
    port: int,
    target_fn: Callable[..., Any],
    args: Sequence[Any],
    results: Any,
    env: Mapping[str, str | None],
    init_timeout_s: float,
    parent_env: Mapping[str, str],
) -> None:
    os.environ.clear()  # the server's environment is the test process's when the server started
    os.environ.update(parent_env)
    os.environ.update(
        {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size),
            "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
            "OMP_NUM_THREADS": "1",
        }
    )
    for name, value in env.items():  # None: unset it (an empty TORCH_FR_BUFFER_SIZE hangs torch's init)
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=init_timeout_s)
        )
        value = target_fn(rank, world_size, *args)
        results.put((rank, True, value))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        # Leave quietly even when a peer is gone: never block the exit on a collective.
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass


def run_ranks(
    world_size: int,
    target_fn: Callable[..., Any],
    args: Sequence[Any] = (),
    timeout: float = 60.0,
    env: Mapping[str, str | None] | None = None,
    init_timeout_s: float = 30.0,
) -> list[Any]:
    """Run ``target_fn(rank, world_size, *args)`` on ``world_size`` real gloo ranks; results by rank.
    ``env``: variables set in each rank before its process group is created (None: unset)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed"])  # read when the server starts
    results = ctx.Queue()
    port = free_port()
    setup = (results, dict(env or {}), init_timeout_s, dict(os.environ))
    procs = [
        ctx.Process(target=_child, args=(rank, world_size, port, target_fn, tuple(args), *setup), daemon=True)
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    got: dict[int, tuple[bool, Any]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(got) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"ranks {sorted(set(range(world_size)) - set(got))} did not answer within {timeout} s "
                    f"(answered: {sorted(got)})"
                )
            try:
                rank, ok, value = results.get(timeout=min(remaining, 0.5))
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(procs) if r not in got and p.exitcode not in (None,)]
                if dead:
                    # A rank exited without answering (crashed hard): give the queue a moment, then fail.
                    try:
                        rank, ok, value = results.get(timeout=2.0)
                    except queue_mod.Empty:
                        raise RankError(
                            f"ranks {dead} exited without a result (exit codes "
                            f"{[procs[r].exitcode for r in dead]})"
                        ) from None
                else:
                    continue
            got[rank] = (ok, value)
    finally:
        for proc in procs:
            proc.join(timeout=5.0 if len(got) == world_size else 0.0)
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5.0)
        results.close()
    errors = [f"rank {r}:\n{v}" for r, (ok, v) in sorted(got.items()) if not ok]
    if errors:
        raise RankError("\n".join(errors))
    return [got[r][1] for r in range(world_size)]
