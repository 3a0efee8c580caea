"""What the benchmarks' smoke tests may assume of a record's figures."""

from __future__ import annotations

# A smoke run's floor comes from the bandwidth and matmul rate measured on this (often loaded)
# CPU, and a tiny model's working set fits in cache, so ours can meet or pass it. The bound
# catches a ratio turned upside down (tens or hundreds), not speed: timed tests assert none.
FLOOR_SLACK = 1.5
