"""Runnable examples: a small GPT-style model trained on synthetic data with checkpointing and the monitor."""
