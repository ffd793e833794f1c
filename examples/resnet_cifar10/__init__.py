"""ResNet image classification (CIFAR-10 or scikit-learn digits) with Flax NNX."""
