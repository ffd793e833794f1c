"""Flax NNX examples trained with the GRPO optax chain."""
