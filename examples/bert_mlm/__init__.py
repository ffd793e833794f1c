"""Masked-language-model pre-training of a small BERT with Flax NNX."""
