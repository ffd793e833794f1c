"""``python -m examples.resnet_cifar10``."""

from examples.resnet_cifar10 import main

if __name__ == "__main__":
  main.main()
