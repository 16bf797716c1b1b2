"""Hang attribution: which rank the others wait for, from every rank's Flight Recorder, through
files in the run directory (no collective needed). Design: docs/design/diagnostics.md#hang-attribution.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from otel_train.diagnostics.collectives import (
    CollectiveMonitor,
    gloo_retired,
    group_label,
    op_name,
    read_dump,
)
from otel_train.health import EventChannel
from otel_train.run_directory import RunFiles, read_regular_file, replace_whole

log = logging.getLogger("otel_train")

DEFAULT_GROUP = "0"  # the name torch gives the default process group (its description: default_pg)
KEEP_OPS = 8  # the last ops per group kept in a summary (the waiting ranks' op is the newest)
# A rank's summary is a few KiB per process group; a file beyond this is damaged or planted and is
# skipped before it is parsed (json.loads of 100 MB took +0.7 GB).
MAX_SUMMARY_BYTES = 4 << 20
REQUEST_POLL_S = 1.0  # how often a rank that is not stalled looks for a stalled peer's question
MAX_ENV_BYTES = 64 << 20  # env.json names every rank of the launch (about 100 bytes each)


def summarize(
    dump: Mapping[str, Any], excluded: Iterable[str], rank: int, world_size: int, host: str,
    stacks: Path | None, last_seconds: float | None,
) -> dict[str, Any]:  # fmt: skip
    """What a rank's collectives look like now (the content of `collectives.rank<k>.json`)."""
    skip = set(excluded)
    retired = gloo_retired(dump)
    groups: dict[str, dict[str, Any]] = {}
    for name, status in (dump.get("pg_status") or {}).items():
        if str(name) in skip:
            continue
        enqueued = int(status.get("last_enqueued_collective", -1))
        completed = int(status.get("last_completed_collective", -1))
        done = retired.get(str(name), set())
        while completed < enqueued and completed + 1 in done:
            completed += 1
        groups[str(name)] = {
            "label": f"pg{name}",
            "last_enqueued": enqueued,
            "last_completed": completed,
            "ops": {},
        }
    for entry in dump.get("entries") or []:
        group = groups.get(str((entry.get("process_group") or ["?"])[0]))
        if group is None or entry.get("is_p2p"):
            continue
        seq = entry.get("collective_seq_id")
        if not _is_int(seq):  # an entry without a sequence id: skip it
            continue
        group["label"] = group_label(entry)
        group["ops"][str(seq)] = op_name(entry)
    for group in groups.values():
        newest = sorted(group["ops"], key=int)[-KEEP_OPS:]
        group["ops"] = {seq: group["ops"][seq] for seq in newest}
    return {
        "rank": rank, "world_size": world_size, "host": host, "written_at": time.time(),
        "last_seconds": last_seconds, "stacks": str(stacks) if stacks is not None else None,
        "groups": groups,
    }  # fmt: skip


@dataclass(frozen=True)
class Verdict:
    """In `group`, ranks `waiting` sit in collective `seq` (`op`) that ranks `missing` never reached."""

    group: str
    op: str
    seq: int
    missing: tuple[int, ...]
    waiting: tuple[int, ...]
    silent: tuple[int, ...]  # ranks that left no summary (named when no member is missing)

    def culprits(self) -> tuple[int, ...]:
        return self.missing or self.silent

    def busy(self, summaries: Mapping[int, Mapping[str, Any]]) -> bool:
        """Whether every culprit answered that it is not stalled (`HangReporter.answer_requests`):
        the others wait for ranks busy outside the collective (an evaluation, a checkpoint, a
        data wait on some ranks only), which is no hang."""
        return all(summaries.get(r, {}).get("progressing") is True for r in self.culprits())

    def describe(self, summaries: Mapping[int, Mapping[str, Any]]) -> str:
        who = ", ".join(_rank_at(r, summaries) for r in self.culprits())
        what = "never reached" if self.missing else "left no readable Flight Recorder summary for"
        waiting = ",".join(str(r) for r in self.waiting)
        why = ""
        if self.busy(summaries):
            what = "has not reached" if len(self.culprits()) == 1 else "have not reached"
            why = (
                ": not stalled, it is busy outside that collective (an evaluation, a checkpoint or a "
                "data wait on some ranks only?)"
            )
        return (
            f"{who} {what} {self.op} #{self.seq} of process group {self.group}, "
            f"where rank(s) {waiting} wait{why}; stacks: {', '.join(stack_files(self, summaries)) or 'none'}"
        )

    def attributes(self, summaries: Mapping[int, Mapping[str, Any]]) -> dict[str, str | int]:
        culprits = self.culprits()
        return {
            "process_group": self.group,
            "op": self.op,
            "sequence_id": self.seq,
            "missing_ranks": ",".join(str(r) for r in culprits),
            "missing_hosts": ",".join(str(summaries.get(r, {}).get("host", "?")) for r in culprits),
            "waiting_ranks": ",".join(str(r) for r in self.waiting),
            "files": ",".join(stack_files(self, summaries)),
        }


@dataclass(frozen=True)
class Deadlock(Verdict):
    """Waits that close a cycle: `hops[i]`'s ranks wait for `hops[i + 1]`'s (the last for the
    first's), each hop (the waiting rank, the verdict of the group it waits in). Its groups and ops
    are theirs joined, its missing ranks the hops' and its waiting ranks their verdicts'."""

    hops: tuple[tuple[int, Verdict], ...] = ()

    @classmethod
    def of(cls, hops: tuple[tuple[int, Verdict], ...]) -> Deadlock:
        return cls(
            group=",".join(dict.fromkeys(v.group for _, v in hops)),
            op=",".join(dict.fromkeys(v.op for _, v in hops)),
            seq=hops[0][1].seq,
            missing=tuple(sorted({rank for rank, _ in hops})),
            waiting=tuple(sorted({r for _, v in hops for r in v.waiting})),
            silent=(),
            hops=hops,
        )

    def describe(self, summaries: Mapping[int, Mapping[str, Any]]) -> str:
        waits = []
        for i, (rank, verdict) in enumerate(self.hops):
            awaited = self.hops[(i + 1) % len(self.hops)][0]
            waits.append(
                f"{_rank_at(rank, summaries)} waits in {verdict.op} #{verdict.seq} of process group "
                f"{verdict.group} for rank {awaited}"
            )
        return (
            f"deadlock across process groups: {'; '.join(waits)}. Ranks {', '.join(map(str, self.missing))} "
            f"call these groups' collectives in different orders; stacks: "
            f"{', '.join(stack_files(self, summaries)) or 'none'}"
        )

    def attributes(self, summaries: Mapping[int, Mapping[str, Any]]) -> dict[str, str | int]:
        cycle = " -> ".join(f"rank {r} ({v.group})" for r, v in self.hops)
        return {**super().attributes(summaries), "cycle": cycle}


def _cycle(verdicts: list[Verdict]) -> Deadlock | None:
    """The shortest cycle of waits (a rank waiting in one verdict's group for a rank that waits
    in another's: within one group a waiting rank is never missing), from its lowest rank; None
    without one."""
    edges: dict[int, list[tuple[int, Verdict]]] = {}
    for verdict in verdicts:
        for waiter in verdict.waiting:
            for awaited in verdict.missing:
                edges.setdefault(waiter, []).append((awaited, verdict))
    best: list[tuple[int, Verdict]] | None = None
    for start in sorted(edges):
        # breadth first from `start`: the shortest way back to it
        paths: dict[int, list[tuple[int, Verdict]]] = {start: []}  # rank -> the waits from start to it
        queue, cycle = deque([start]), None
        while queue and cycle is None:
            rank = queue.popleft()
            for awaited, verdict in edges.get(rank, []):
                if awaited == start:
                    cycle = [*paths[rank], (rank, verdict)]
                    break
                if awaited not in paths:
                    paths[awaited] = [*paths[rank], (rank, verdict)]
                    queue.append(awaited)
        if cycle is not None and (best is None or len(cycle) < len(best)):
            best = cycle
    return Deadlock.of(tuple(best)) if best is not None else None


def _rank_at(rank: int, summaries: Mapping[int, Mapping[str, Any]]) -> str:
    host = summaries.get(rank, {}).get("host")
    return f"rank {rank}" + (f" ({host})" if host else "")


def stack_files(verdict: Verdict, summaries: Mapping[int, Mapping[str, Any]]) -> list[str]:
    """The culprits' stack files first, then the waiting ranks'."""
    ranks = dict.fromkeys([*verdict.culprits(), *verdict.waiting])
    return [str(summaries[r]["stacks"]) for r in ranks if r in summaries and summaries[r].get("stacks")]


def attribute(summaries: Mapping[int, Mapping[str, Any]], world_size: int) -> list[Verdict]:
    """Every group where some ranks wait in a collective others never reached, most waiters first;
    ahead of them a cycle of such waits across groups (a `Deadlock`), when there is one."""
    members: dict[str, dict[int, Mapping[str, Any]]] = {}
    for rank, summary in summaries.items():
        for name, group in (summary.get("groups") or {}).items():
            members.setdefault(name, {})[rank] = group
    silent = tuple(r for r in range(world_size) if r not in summaries)
    verdicts = []
    for name, groups in members.items():
        # Only the default group (name "0") surely has every rank as a member: a rank that left no
        # file is named there only; another group's members are known by the files alone.
        absent = silent if name == DEFAULT_GROUP else ()
        top = max(int(g["last_enqueued"]) for g in groups.values())
        waiting = tuple(
            sorted(r for r, g in groups.items() if g["last_enqueued"] == top and g["last_completed"] < top)
        )
        missing = tuple(sorted(r for r, g in groups.items() if g["last_enqueued"] < top))
        if not waiting or not (missing or absent):
            continue  # nobody blocked here, or all members inside the same collective (a network fault)
        op = next((g["ops"][str(top)] for g in groups.values() if str(top) in g["ops"]), "?")
        label = str(groups[waiting[0]].get("label", "?"))
        verdicts.append(Verdict(label, op, top, missing, waiting, () if missing else absent))
    ordered: list[Verdict] = sorted(verdicts, key=lambda v: (-len(v.waiting), v.group))
    deadlock = _cycle(verdicts)
    return ordered if deadlock is None else [deadlock, *ordered]


def with_launch_hosts(
    summaries: Mapping[int, Mapping[str, Any]], run_dir: Path, role: str = ""
) -> dict[int, Mapping[str, Any]]:
    """`summaries`, and for each rank that left none (dead or frozen: when its host matters most)
    its host as the launch check gathered it at init (env.json), for the verdict's words only."""
    try:
        env = json.loads(read_regular_file(RunFiles(run_dir, role=role).env, MAX_ENV_BYTES))
        ranks = env["launch"]["ranks"]
        hosts = {int(r["rank"]): {"host": str(r["host"])} for r in ranks if r.get("host")}
    except (OSError, ValueError, TypeError, KeyError, AttributeError):  # no env.json, or not the launch's
        hosts = {}
    return {**hosts, **summaries}


# (its written_at, its file's mtime), unix time: a summary that reaches either is of this stall. The
# ranks' clocks may disagree by more than the window (hosts apart, one off); a shared file system
# stamps every file's mtime with one clock.
Since = tuple[float, float]


def read_summaries(run_dir: Path, since: Since = (0.0, 0.0), role: str = "") -> dict[int, dict[str, Any]]:
    """Every rank's summary (of `role`) in `run_dir` written since `since`."""
    return scan_summaries(run_dir, since, role)[0]


def summary_since(path: Path, written_at: float, window_s: float) -> Since:
    """The `Since` of the summaries of a stall whose newest summary is the file `path`, written at
    `written_at`: `window_s` before either of its stamps."""
    try:
        modified = path.stat().st_mtime
    except OSError:
        modified = math.inf  # the written_at stamps alone
    return written_at - window_s, modified - window_s


def scan_summaries(
    run_dir: Path, since: Since = (0.0, 0.0), role: str = ""
) -> tuple[dict[int, dict[str, Any]], list[str]]:
    """`read_summaries`, and one line for each file it skipped as unreadable or malformed (a
    truncated file, another version's, a stray JSON): `otel-train diagnose` names them."""
    found: dict[int, dict[str, Any]] = {}
    skipped: list[str] = []
    for path in sorted(run_dir.glob(RunFiles(run_dir, role=role).collectives_glob)):
        named = re.search(r"\.rank(\d+)\.json$", path.name)
        try:
            summary = json.loads(read_regular_file(path, MAX_SUMMARY_BYTES).decode("utf-8"))
        except (OSError, ValueError) as exc:  # ValueError: not JSON (truncated), not UTF-8
            reason = (exc.strerror or exc) if isinstance(exc, OSError) else exc
            skipped.append(f"{path.name}: unreadable ({reason})")
            continue
        problem = _malformed(summary)
        if problem is None and (named is None or named.group(1) != str(summary["rank"])):
            # one rank's file never stands in for another's (a copied or forged file)
            problem = f"claims rank {summary['rank']}, but its name is another rank's"
        if problem is not None:
            skipped.append(f"{path.name}: {problem}")
        elif summary["written_at"] >= since[0] or _modified(path) >= since[1]:
            found[summary["rank"]] = summary
    return found, skipped


def _modified(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return -math.inf


def _write_whole(path: Path, content: Mapping[str, Any]) -> bool:
    """`content` as JSON at `path`, whole or absent for the peers polling for it."""
    try:
        replace_whole(path, json.dumps(content))
    except OSError as exc:
        log.debug("otel_train: cannot write %s (%s)", path, exc)
        return False
    return True


def _answered(summaries: Mapping[int, Mapping[str, Any]], asked: Since, run_dir: Path, role: str) -> set[int]:
    """The ranks whose summary was written after the question asked at `asked` (by its written_at
    or its file's mtime: one host's clock may be off)."""
    return {
        rank for rank, summary in summaries.items()
        if float(summary["written_at"]) >= asked[0] or _modified(RunFiles(run_dir, rank, role).collectives) >= asked[1]
    }  # fmt: skip


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


MAX_RANKS = 1 << 20  # a rank or world size beyond this is no job's: a forged or damaged file


def _is_seconds(value: Any) -> bool:
    """A finite number of seconds that float() takes (an int of 400 digits overflows it)."""
    if _is_int(value):
        return bool(abs(value) < 1 << 62)
    return isinstance(value, float) and math.isfinite(value)


def _malformed(summary: Any) -> str | None:
    """Why `attribute` and `otel-train diagnose` cannot read this summary, or None (it is skipped,
    never a crash, nor a hang of diagnose, which looks at every rank below the world size)."""
    if not isinstance(summary, dict):
        return f"not a summary (a JSON {type(summary).__name__})"
    rank: Any = summary.get("rank")
    world_size: Any = summary.get("world_size")  # optional
    if not _is_int(rank) or not 0 <= rank < MAX_RANKS:
        return f"no valid rank ({rank!r})"
    if not _is_seconds(summary.get("written_at")):
        return f"no valid written_at ({summary.get('written_at')!r})"
    if world_size is not None and not (_is_int(world_size) and rank < world_size <= MAX_RANKS):
        return f"no valid world_size ({world_size!r} for rank {rank})"
    window = summary.get("stall_timeout_s")  # optional
    if window is not None and not (_is_seconds(window) and window >= 0):
        return f"no valid stall_timeout_s ({window!r})"
    groups = summary.get("groups")
    if not isinstance(groups, dict) or not all(
        isinstance(g, dict)
        and _is_int(g.get("last_enqueued"))
        and _is_int(g.get("last_completed"))
        and isinstance(g.get("ops"), dict)
        for g in groups.values()
    ):
        return "no valid groups (last_enqueued, last_completed and ops for each process group)"
    return None


class HangReporter:
    """At a stall (the watchdog calls `on_stall`): write this rank's summary, wait for the others',
    and, on the rank chosen to speak, emit the `hang` event."""

    def __init__(
        self, run_dir: Path, rank: int, world_size: int, host: str, events: EventChannel,
        monitor: CollectiveMonitor, stall_timeout_s: float, role: str = "",
    ) -> None:  # fmt: skip
        self.run_dir, self.rank, self.world_size, self.host = run_dir, rank, world_size, host
        self._events = events
        self._monitor = monitor
        self._stall_timeout_s = stall_timeout_s
        self.role = role  # ranks of one role share a process group; another role's files are not read
        # Ranks stall within a poll of each other (their last steps end together); a rank that
        # stalls later than this is not waited for, and named as silent when no member is missing.
        self.grace_s = min(max(2.0, stall_timeout_s / 2), 30.0)
        self.verdicts: list[Verdict] = []  # the last comparison (tests read it)
        self._files = RunFiles(run_dir, rank, role)
        self._answered_at = 0.0  # the request this rank last answered (its written_at)
        self._request_checked = 0.0  # monotonic time of the last look at the request file
        # Whether this rank's stall lasts (the watchdog's; set at assembly): while it does, ranks
        # named busy are asked again, and one that stops answering or stalls itself makes a `hang`.
        self.stalled: Callable[[], bool] = lambda: False

    def on_stall(self, stacks: Path | None) -> None:
        summary = self._write_summary(stacks)
        if summary is None:
            return
        since = summary_since(self._files.collectives, float(summary["written_at"]), self._stall_timeout_s)
        threading.Thread(target=self._compare, args=(since,), name="otel_train-hang", daemon=True).start()

    def answer_requests(self) -> None:
        """On the watchdog's tick of a rank that is NOT stalled: a stalled peer asked the ranks
        that left no summary whether they are alive (`_ask_the_silent`); this one writes its
        summary, marked progressing, so it is named as busy rather than as dead. At most one look at
        the request file every REQUEST_POLL_S (one stat)."""
        now = time.monotonic()
        if now - self._request_checked < REQUEST_POLL_S:
            return
        self._request_checked = now
        path = self._files.hang_request
        try:
            request = json.loads(read_regular_file(path, MAX_SUMMARY_BYTES))
            asked_at = float(request["written_at"])
        except (OSError, ValueError, TypeError, KeyError):  # no request (the usual case), or a damaged one
            return
        # Only a question asked within its wait (by its stamp or its file's mtime: one host's clock
        # may be off), by another rank: an old one answered would overwrite this rank's summary
        # from its own stall, the evidence `otel-train diagnose` reads.
        waited = self.grace_s + 2 * REQUEST_POLL_S
        fresh = time.time() - asked_at <= waited or time.time() - _modified(path) <= waited
        if fresh and request.get("by") != self.rank and asked_at > self._answered_at:
            self._answered_at = asked_at
            self._write_summary(None, progressing=True)

    def _write_summary(self, stacks: Path | None, progressing: bool = False) -> dict[str, Any] | None:
        dump = read_dump(entries=True)
        if dump is None:
            return None
        last = self._monitor.last_seconds()
        summary = summarize(dump, self._monitor.excluded, self.rank, self.world_size, self.host, stacks, last)
        summary["stall_timeout_s"] = self._stall_timeout_s  # the window `otel-train diagnose` reads in
        if progressing:
            summary["progressing"] = True
        path = self._files.collectives
        if not _write_whole(path, summary):
            log.warning("otel_train: cannot write %s: no hang attribution from this rank", path)
            return None
        return summary

    def _ask(self, since: Since, again: Iterable[int] = ()) -> dict[int, dict[str, Any]]:
        """Ask the ranks that left no summary, and those in `again` (which answered before), whether
        they are alive (`answer_requests`), and wait a grace for their answers; what the summaries
        are then. A rank of `again` that did not answer this question is no longer vouched for as
        progressing (frozen or gone since)."""
        asked_at = time.time()
        request = self._files.hang_request
        _write_whole(request, {"written_at": asked_at, "by": self.rank})
        asked = (asked_at, _modified(request))  # an answer reaching either stamp answers this question
        again = set(again)
        deadline = time.monotonic() + self.grace_s + 2 * REQUEST_POLL_S
        summaries = read_summaries(self.run_dir, since, self.role)
        while time.monotonic() < deadline and (
            len(summaries) < self.world_size
            or not again <= _answered(summaries, asked, self.run_dir, self.role)
        ):
            time.sleep(0.2)
            summaries = read_summaries(self.run_dir, since, self.role)
        with contextlib.suppress(OSError):
            request.unlink()  # answered: a rank that looks later has nothing to answer
        answered = _answered(summaries, asked, self.run_dir, self.role)
        for rank in again - answered:
            if rank in summaries:
                summaries[rank] = {k: v for k, v in summaries[rank].items() if k != "progressing"}
        return summaries

    def _watch_the_busy(self, since: Since, busy: tuple[int, ...]) -> None:
        """After a `collective_wait`, while this rank's stall lasts: ask the busy ranks again every
        stall timeout. One that stopped answering (frozen, or its host gone) or that stalled itself
        (its own summary, not marked progressing) is a culprit: the wait is then a `hang`."""
        period = max(self.grace_s, self._stall_timeout_s)
        asked = time.monotonic()
        while self.stalled():
            if time.monotonic() - asked < period:
                time.sleep(min(0.5, period))
                continue
            summaries = self._ask(since, busy)
            asked = time.monotonic()
            if not self.stalled():
                return  # the wait ended while the question was out
            verdicts = attribute(summaries, self.world_size)
            named = with_launch_hosts(summaries, self.run_dir, self.role)
            if verdicts and not verdicts[0].busy(named):
                self.verdicts = verdicts
                with contextlib.suppress(Exception):  # never let the report kill the thread noisily
                    self._events.emit("hang", verdicts[0].describe(named), verdicts[0].attributes(named))
                return

    def _lower_rank_silent(self, summaries: Mapping[int, Any]) -> bool:
        """Would this rank speak only because a lower rank, which would speak instead, left no
        summary yet, though the culprit is known (design page, #hang-attribution)?"""
        verdict = self.verdicts[0] if self.verdicts else None
        speaks = verdict is not None and verdict.waiting[0] == self.rank and bool(verdict.missing)
        return speaks and any(r not in summaries for r in range(self.rank))

    def _compare(self, since: Since) -> None:
        deadline = time.monotonic() + self.grace_s
        summaries = read_summaries(self.run_dir, since, self.role)
        while len(summaries) < self.world_size and time.monotonic() < deadline:
            time.sleep(0.2)
            summaries = read_summaries(self.run_dir, since, self.role)
        self.verdicts = attribute(summaries, self.world_size)
        if self._lower_rank_silent(summaries):
            deadline = time.monotonic() + self.grace_s
            while self._lower_rank_silent(summaries) and time.monotonic() < deadline:
                time.sleep(0.2)
                summaries = read_summaries(self.run_dir, since, self.role)
            self.verdicts = attribute(summaries, self.world_size)
        if not self.verdicts or self.verdicts[0].waiting[0] != self.rank:
            return  # nothing to name, or another rank speaks for the job
        if not self.verdicts[0].missing:  # only silent ranks: dead or frozen, or busy? ask them
            summaries = self._ask(since)
            self.verdicts = attribute(summaries, self.world_size)
            if not self.verdicts or self.verdicts[0].waiting[0] != self.rank:
                return
        verdict, named = self.verdicts[0], with_launch_hosts(summaries, self.run_dir, self.role)
        # A wait for ranks that answered they are busy is no hang: `collective_wait`, not paged.
        event = "collective_wait" if verdict.busy(named) else "hang"
        with contextlib.suppress(Exception):  # never let the report kill the thread noisily
            self._events.emit(event, verdict.describe(named), verdict.attributes(named))
        if event == "collective_wait":
            self._watch_the_busy(since, verdict.culprits())
