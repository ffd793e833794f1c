"""RL on multi-digit addition with grpo_optax.rl (group relative policy optimisation)."""
