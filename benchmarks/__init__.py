"""Benchmarks of checkpointing overhead, activation memory and the cost of the recomputation check.

Run them with ``python benchmarks/run.py`` (``--help`` lists the options).
"""
