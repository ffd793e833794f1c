"""``python -m examples.rl_arithmetic``."""

from examples.rl_arithmetic import main

if __name__ == "__main__":
  main.main()
