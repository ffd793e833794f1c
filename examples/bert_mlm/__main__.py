"""``python -m examples.bert_mlm``."""

from examples.bert_mlm import main

if __name__ == "__main__":
  main.main()
