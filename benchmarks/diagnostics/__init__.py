"""Diagnostics kept beside the benchmarks: the batch-1 critical path (diag_decode_b1) and the read floor
(diag_floor). Run as `python -m benchmarks.diagnostics.<name>`."""
