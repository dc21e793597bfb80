"""Registered target pairs. Every module under this package is imported by the registry and
registers its pairs at import time: `ops/` (one file per op family), `models/` (small full
models), `backends/` (other engines). Adding a file here is all it takes to add a pair."""
