"""The telemetry exchange as a tree of bounded fan-in (`tree.layout`): each rank's CPU, bytes
and messages per flush are O(fan-in), whatever the job size; a fan-in >= the world size is the
star (`exchange`). Design: docs/design/crossrank.md#tree-exchange.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

from otel_train.crossrank import down_row, job_block, wire
from otel_train.crossrank.exchange import MAX_HELD, Exchanged, ExchangeFailed, StarExchange
from otel_train.crossrank.merge import HEAD, HEAD_LEN, Bundle, bundle_len, decode, encode, join, merge
from otel_train.crossrank.tree import Layout, layout
from otel_train.crossrank.up_row import pack_len, row_steps

KEPT_OWN = 4  # rank 0: its own rows of that many last flushes, for bundles that come late


class TreeExchange:
    """One flush's exchange on a tree (module doc); the interface of `exchange.StarExchange.run`."""

    def __init__(self, group: Any, rank: int, layout: Layout, timeout_s: float, grace_s: float) -> None:
        self.rank = rank
        self.layout = layout
        self.children = layout.children[rank]
        self.parent = layout.parent[rank]
        # its rows: the up row and its blocks (`wire.row`), of which the `up_row` part is `base_len`
        self.row_len, self.base_len = wire.row().words, pack_len()
        world, down = layout.world, down_row.TREE_DOWN_LEN
        self.below: StarExchange | None = None
        self.above: StarExchange | None = None
        if self.children:
            self.below = StarExchange(
                group, rank, world, timeout_s, grace_s, peers=self.children, down_len=down
            )
            # each child's bundles are of a fixed length: its subtree's size decides it
            self.below.up_lens = {
                c: bundle_len(self.row_len, self.base_len, self._ranks(c)) for c in self.children
            }
        if self.parent >= 0:
            self.above = StarExchange(
                group, rank, world, timeout_s, grace_s, parent=self.parent, down_len=down
            )
        self.left_out_bundles = 0  # bundles (its own row too) of other steps than the ones kept (step 1)
        self._expect: set[int] | None = None  # children whose bundles to wait for (None: all)
        self._own: dict[tuple[int, int], Bundle] = {}  # rank 0: its rows of its last flushes, by steps
        # Each child's bundles that reach past this rank's flush (at most MAX_HELD each), kept for
        # the flush that reaches them (step 1 of docs/design/crossrank.md#tree-exchange).
        self._held: dict[int, list[Bundle]] = {}
        self._job_unsent: Any = None  # the job block of a bundle that could not go up (sent with the next)
        self._sent_through = -1  # a rank with a parent: the last step of the newest bundle it sent up
        self._own_through = -1  # the last step of its own row at its previous flush

    @property
    def _edges(self) -> list[StarExchange]:
        return [edge for edge in (self.below, self.above) if edge is not None]

    def stamp(self, clock: Callable[[], float]) -> None:
        for edge in self._edges:
            edge.stamp(clock)

    @property
    def sent_bytes(self) -> int:
        return sum(edge.sent_bytes for edge in self._edges)

    @property
    def received_bytes(self) -> int:
        return sum(edge.received_bytes for edge in self._edges)

    @property
    def skipped(self) -> int:
        return self.above.skipped if self.above is not None else 0

    def stop_waiting(self) -> None:
        for edge in self._edges:
            edge.stop_waiting()

    def run(self, up: Any, answer: Any | None, job: Any = None) -> Exchanged:
        """`up`: this rank's row; `answer`: rank 0's `down_row.tree_answer` (None elsewhere);
        `job`: this rank's `job_block`. Rank 0 gets `records`: the merged `merge.Bundle` of the
        whole tree, whose `job` sums every bundle taken (module doc of `job_block`)."""
        import torch

        own = Bundle.of_row(up.tolist(), self.rank, up)
        steps = row_steps(up)
        parts, taken, answers = [own], list[int](), dict[int, Any]()
        jobs = [job_block.empty() if job is None else job]
        if self._job_unsent is not None:
            jobs.append(self._job_unsent)
        if self.below is not None:
            parts, taken, answers = self._gather(up, own, steps, answer, jobs)
        if self.above is None:  # rank 0: its deputy's bundle as it came (tree.layout)
            merged = join(*parts) if len(parts) == 2 else merge(parts)
            merged.job = torch.stack(jobs)  # merged when exported (crossrank/job_outputs)
            return Exchanged(merged, answer, [self.rank, *taken])
        merged = merge(parts)
        merged.job = job_block.combine(jobs)
        try:
            got = self.above.send_up(self._encode(merged, self.rank))
        except ExchangeFailed as exc:
            if self.below is not None:
                self.below.abort_peers(answers, gone=exc.gone)  # pass the ABORT down
            raise
        # Every bundle taken is counted once: one that could not go up goes with the next.
        self._job_unsent = None if got.sent else merged.job
        if self.below is not None and taken:
            news = got.down if got.down is not None else down_row.tree_answer(0, None)  # nothing to adopt
            for peer in set(taken):
                stamp = answers[peer][down_row.D_T2]
                answers[peer] = news.clone()
                answers[peer][down_row.D_T2] = stamp
            self.below.answer(taken, answers)
        return got

    def _gather(
        self, up: Any, own: Bundle, steps: tuple[int, int], answer: Any | None, jobs: list[Any]
    ) -> tuple[list[Bundle], list[int], dict[int, Any]]:
        """Step 1 (design page): this rank's bundle and its children's that cover its steps. The
        job blocks of every bundle taken join `jobs`, of whatever steps (each is taken once)."""
        assert self.below is not None
        root = self.parent < 0
        template = answer if root and answer is not None else down_row.tree_answer(0, None)
        answers = {peer: template.clone() for peer in [self.rank, *self.children]}  # own: unused
        # A child whose held bundle reaches this flush has sent its bundle for it: not waited for.
        ready = {peer for peer, held in self._held.items() if any(_steps(b)[1] >= steps[1] for b in held)}
        expect = set(self.children if self._expect is None else self._expect) - ready
        # A rank whose own steps are behind its children's reaches for the steps after those it sent
        # up last, so a child whose bundle came a flush late catches up with the others; from where
        # its own steps began again (a restarted loop), for those only.
        if steps[1] < self._own_through:
            self._sent_through = -1
        self._own_through = steps[1]
        reach = steps[1] if root else max(steps[1], self._sent_through + 1)
        try:
            got = self.below.gather(
                up, answers, expect, lambda b: row_steps(b[HEAD_LEN:])[1] >= reach, defer=not root
            )
        except ExchangeFailed as exc:
            self._fail_up(own, exc.gone)
            raise
        taken = got.ranks[1:]
        assert got.records is not None
        bundles: list[tuple[int, Bundle]] = []
        for peer, message in zip(taken, got.records[1:], strict=True):
            version = message[HEAD.at("version")].item()
            if version != wire.VERSION:  # a failed child below, or another release: turn off
                gone = int(message[HEAD.at("gone")].item()) if version == wire.FAILED else -1
                self.below.abort_peers(answers, gone=gone)
                self._fail_up(own, gone)
                if version == wire.FAILED:
                    raise ExchangeFailed(f"a rank below found a failed peer (reported by rank {peer})", gone)
                raise ExchangeFailed(wire.refusal(version, f"rank {peer}"))
            bundles.append((peer, decode(message, self.row_len, self.base_len, self._ranks(peer))))
            jobs.append(bundles[-1][1].job)  # counted here, once, whether the bundle is held or not
        self._expect = set(taken) | set(self._held)  # the children in at this flush
        return self._parts(own, steps, bundles, ready), taken, answers

    def _parts(
        self, own: Bundle, steps: tuple[int, int], fresh: list[tuple[int, Bundle]], ready: set[int]
    ) -> list[Bundle]:
        """Step 1's choice (design page): hold the children's bundles that reach past this flush,
        keep those of the steps most ranks at hand cover (and this rank's row of them); count the rest."""
        mine = {steps: own}
        if self.above is None:  # rank 0 joins a bundle that came a flush or more late
            mine = {**self._own, steps: own}
            self._own = dict(list(mine.items())[-KEPT_OWN:])
        candidates = [(peer, b) for peer, held in self._held.items() for b in held] + fresh
        self._held = {}
        now = []
        for peer, bundle in candidates:
            if not bundle.exact:
                self.left_out_bundles += 1
            elif not self._holds(_steps(bundle), steps, peer in ready):
                now.append(bundle)
            elif len(self._held.setdefault(peer, [])) < MAX_HELD:
                self._held[peer].append(bundle)
            else:  # a child this far ahead is not in step with this rank: never paired
                self.left_out_bundles += 1
        self._held = {peer: held for peer, held in self._held.items() if held}
        weight = {at: 1 for at in mine}
        for bundle in now:
            weight[_steps(bundle)] = weight.get(_steps(bundle), 0) + bundle.ranks
        # Rank 0 pairs only steps of its own rows; most ranks, then its current steps, the newest.
        best = max(mine if self.above is None else weight, key=lambda at: (weight[at], at == steps, at[1]))
        parts = [mine[best]] if best in mine else []
        for bundle in now:
            if _steps(bundle) == best:
                parts.append(bundle)
            else:
                self.left_out_bundles += 1
        if self.above is None and len(parts) > 1:  # a view of those steps is made: never again
            self._own = {at: row for at, row in self._own.items() if at[1] > best[1]}
        if self.above is not None and parts:
            self._sent_through = max(self._sent_through, best[1])
        return parts

    def _holds(self, at: tuple[int, int], steps: tuple[int, int], ready: bool) -> bool:
        """Whether a child's bundle of steps `at` waits for a later flush of this rank (of `steps`);
        why rank 0 and the other ranks hold different ones: step 1 of the design page."""
        if at[1] <= steps[1]:
            return False
        return self.above is None or ready or at[0] < steps[1]

    def _ranks(self, rank: int) -> int:
        lo, hi = self.layout.span[rank]
        return hi - lo

    def _encode(self, bundle: Bundle, rank: int) -> Any:
        return encode(bundle, self.row_len, self.base_len, self._ranks(rank))

    def _fail_up(self, own: Bundle, gone: int) -> None:
        """Tell the parent at once (a FAILED bundle naming the rank `gone`), so it need not wait
        out its timeout."""
        if self.above is None:
            return
        message = self._encode(own, self.rank)
        message[HEAD.at("version")], message[HEAD.at("gone")] = wire.FAILED, float(gone)
        with contextlib.suppress(ExchangeFailed):  # turning off anyway
            self.above.send_up(message)


def _steps(bundle: Bundle) -> tuple[int, int]:
    """The steps a bundle covers: those of its first exact row (the merging rank's own, when kept)."""
    return row_steps(bundle.exact[0])


def exchange_for(
    group: Any,
    rank: int,
    world: int,
    timeout_s: float,
    grace_s: float,
    fanin: int,
    nodes: Sequence[int] = (),
) -> StarExchange | TreeExchange:
    """The star when `fanin` reaches every rank from rank 0, else the tree (per node where `nodes`,
    the job's, say where each begins: `shape`). Rows: `up_row` and the two blocks. `fanin` and
    `nodes` must be the same on every rank (`shape.agree`): they decide every message's size."""
    shape = layout(max(world, 1), fanin, nodes=nodes)
    if shape.star:
        return StarExchange(group, rank, world, timeout_s, grace_s)
    return TreeExchange(group, rank, shape, timeout_s, grace_s)
