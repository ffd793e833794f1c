"""RL fine-tuning with group relative policy optimisation (grpo_optax.rl)."""
