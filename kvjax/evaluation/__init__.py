"""Evaluation: policy quality on the testbed (and, later, decode benchmarks)."""
