"""Cross-rank detection: one exchange per flush turns every rank's interval into cross-rank
statistics and straggler verdicts, without ever making one rank wait for another.

The reducer packs a row, the star or tree exchange carries it, rank 0 reduces and judges, its
answer carries the schedule and the verdicts down. Design: docs/design/crossrank.md#one-flush.
From outside, import only the names below (tests/test_architecture.py: walled packages).
"""

from otel_train.crossrank.reducer import CrossRankReducer
from otel_train.crossrank.replicas import FINGERPRINT
from otel_train.crossrank.scores import StragglerReport
from otel_train.crossrank.shape import ExchangeShape, node_key, node_ranks
from otel_train.crossrank.shape import decide as decide_shape

__all__ = [
    "FINGERPRINT",
    "CrossRankReducer",
    "ExchangeShape",
    "StragglerReport",
    "decide_shape",
    "node_key",
    "node_ranks",
]
