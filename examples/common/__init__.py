"""Helpers shared by the examples: optimizer flags, checkpoints, metrics, plots."""
