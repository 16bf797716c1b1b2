"""Cross-rank detection: one exchange per flush turns every rank's interval into cross-rank
statistics and straggler verdicts, without ever making one rank wait for another.

The story of one flush, on the background worker of every rank:

1. `reducer.CrossRankReducer` (the flush listener) packs this rank's interval into ONE fixed-size
   float64 row. The row's format is `up_row` (per-timer mean duration and arrival statistics, step
   statistics, the steps it covers, host), followed by two fixed blocks: `replicas` (the watched
   steps' batch fingerprint and per-layer parameter norms) and `arrival_block` (arrivals at
   collectives read from PyTorch's Flight Recorder, and this rank's clock offset to rank 0).
2. `exchange.StarExchange` carries it, star-shaped around rank 0, on the dedicated gloo group
   (`distributed.create_telemetry_group`): every other rank sends one row up and receives one
   answer down, O(1) bytes whatever the job size; nothing waits for a late peer (rank 0 waits at
   most `exchange_grace_s`, and pairs only rows that cover exactly its own steps). Beyond
   `exchange_fanin` ranks, `tree_exchange.TreeExchange` carries it up a tree (`tree`: per node,
   then a fixed fan-in), each edge a star edge: every rank merges its row and its children's into
   one bounded bundle (`merge`: the rows that stray most, whole, and a mergeable quantile summary
   of the rest) and passes rank 0's answer down, so no rank pays more than O(fan-in).
3. Rank 0 reduces the rows that cover its own steps (`pairing`; in a tree: the bundle's whole rows,
   and its summary rows as weighted ranks that are compared against, never named): `timer_stats`
   (min/max/mean/median of each phase across ranks), `verdicts` (lateness, waits, culprits: the
   straggler model), `scores` (relative and individual scores over flushes, chronic and one-off
   reports), `collective_lateness` (the rank that arrives last at collectives, clock offsets
   bounded NTP-style), `replicas` (`data_not_sharded`, `replica_divergence`); `straggler_outputs`
   turns the verdicts into gauges and `straggler` events.
4. Its answer, in the format `down_row` (the pair of `up_row`), carries the flush schedule
   (`cadence`) and the previous flush's verdicts down: each rank's scores and the chronic
   stragglers, so every rank calls `on_straggler` with the same list.

The exchange's shape (`shape`: rank 0's fan-in, the nodes as every rank reports them) is decided
once for the job, never from one rank's environment: it sets every message's size.

A peer that dies turns the exchange off on every rank; `CrossRankReducer.reform` re-forms it on
the job's new process group among the live ranks.

From outside, import only the names below (tests/test_architecture.py: walled packages).
"""

from otel_train.crossrank.reducer import CrossRankReducer
from otel_train.crossrank.replicas import FINGERPRINT
from otel_train.crossrank.scores import StragglerReport
from otel_train.crossrank.shape import ExchangeShape, node_key
from otel_train.crossrank.shape import decide as decide_shape

__all__ = ["FINGERPRINT", "CrossRankReducer", "ExchangeShape", "StragglerReport", "decide_shape", "node_key"]
