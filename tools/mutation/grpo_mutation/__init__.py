"""cosmic-ray plugins for grpo_optax's curated mutants.

- ``grpo/CuratedSnippet`` (entry point ``cosmic_ray.operator_providers``):
  an operator that replaces one token-anchored snippet of a module
  (:mod:`grpo_mutation.operators`, :mod:`grpo_mutation.anchoring`).
- ``grpo-curated`` (entry point ``cosmic_ray.distributors``): cosmic-ray's
  local, sequential execution, with each work item's own covering tests put
  into the session's test command (:mod:`grpo_mutation.distributor`).

A development tool of the repository, not part of the ``grpo_optax`` wheel:
``pip install -e tools/mutation``.
"""
