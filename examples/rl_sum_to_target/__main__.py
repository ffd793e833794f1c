"""``python -m examples.rl_sum_to_target``."""

from examples.rl_sum_to_target import main

if __name__ == "__main__":
  main.main()
