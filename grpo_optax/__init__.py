"""grpo_optax: composable optax transforms for the GRPO optimizer family."""
from grpo_optax.presets import grpo

__all__ = ["grpo"]
