"""The differential sweep: every registered architecture and path against its reference
(tests/sweep/README.md)."""
