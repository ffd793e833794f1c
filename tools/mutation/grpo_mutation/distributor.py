"""cosmic-ray's local execution, each mutant with its own covering tests."""

from __future__ import annotations

import shlex

from cosmic_ray.distribution.distributor import Distributor
from cosmic_ray.mutating import mutate_and_test

PLACEHOLDER = "{tests}"


def test_command_for(test_command: str, work_item, default=()) -> str:
  """The session's test command with ``{tests}`` replaced by the work
  item's tests: the ``tests`` argument of its mutations (the curated
  operator's), else ``default``.
  """
  tests = [
    t
    for mutation in work_item.mutations
    for t in (mutation.operator_args or {}).get("tests", ())
  ] or list(default)
  if PLACEHOLDER in test_command and not tests:
    raise ValueError(f"work item {work_item.job_id} names no tests")
  return test_command.replace(
    PLACEHOLDER, " ".join(shlex.quote(t) for t in tests)
  )


class CuratedDistributor(Distributor):
  """Runs the pending work items one after the other, in this process.

  As cosmic-ray's ``local`` distributor, except that ``{tests}`` in the
  test command becomes the item's tests (see :func:`test_command_for`;
  ``[cosmic-ray.distributor.grpo-curated] tests = [...]`` is the default for
  items of other operators).
  """

  def __call__(
    self,
    pending_work,
    test_command,
    timeout,
    distributor_config,
    on_task_complete,
  ):
    default = distributor_config.get("tests", ())
    for work_item in pending_work:
      result = mutate_and_test(
        mutations=work_item.mutations,
        test_command=test_command_for(test_command, work_item, default),
        timeout=timeout,
      )
      on_task_complete(work_item.job_id, result)
