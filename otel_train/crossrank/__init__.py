"""Cross-rank detection: one exchange per flush turns every rank's interval into cross-rank
statistics and straggler verdicts, without ever making one rank wait for another.

The story of one flush, on the background worker of every rank:

1. `reducer.CrossRankReducer` (the flush listener) packs this rank's interval into ONE fixed-size
   float64 row. The row's format is `up_row` (per-timer mean duration and arrival statistics, step
   statistics, the steps it covers, host), followed by two fixed blocks: `replicas` (the watched
   steps' batch fingerprint and per-layer parameter norms) and `collective_lateness` (arrivals at
   collectives read from PyTorch's Flight Recorder, and this rank's clock offset to rank 0).
2. `exchange.StarExchange` carries it, star-shaped around rank 0, on the dedicated gloo group
   (`distributed.create_telemetry_group`): every other rank sends one row up and receives one
   answer down, O(1) bytes whatever the job size; nothing waits for a late peer (rank 0 waits at
   most `exchange_grace_s`, and pairs only rows that cover exactly its own steps).
3. Rank 0 reduces the rows: `timer_stats` (min/max/mean/median of each phase across ranks),
   `verdicts` (lateness, waits, culprits: the straggler model, with relative and individual
   scores), `collective_lateness` (the rank that arrives last at collectives, clock offsets
   bounded NTP-style), `replicas` (`data_not_sharded`, `replica_divergence`).
4. Its answer, in the format `down_row` (the pair of `up_row`), carries the flush schedule
   (`cadence`) and the previous flush's verdicts down: each rank's scores and the chronic
   stragglers, so every rank calls `on_straggler` with the same list.

From outside, import only the names below (tests/test_architecture.py: walled packages).
"""

from otel_train.crossrank.reducer import CrossRankReducer
from otel_train.crossrank.replicas import FINGERPRINT

__all__ = ["FINGERPRINT", "CrossRankReducer"]
