"""Tools to property-test collectives — ours or your own — against torch's built-in ones.

* :class:`WorkerPool`: ``N`` ranks started once and reused for many test cases.
* :mod:`collectives.testing.strategies`: :class:`Case` and :func:`cases` (hypothesis strategies
  with filters: collectives, ops, dtypes, world sizes, sizes, layouts, roots, uneven splits).
* :mod:`collectives.testing.calls`: each collective's tensors, its call with torch's signature
  (what your ``impl`` must accept), and the hand-computed expected result.
* :mod:`collectives.testing.checks`: :func:`assert_matches_reference` runs a case on our
  collectives (or your ``impl``) and on torch's, and checks every tensor of every rank.
* :func:`property_test` / ``python -m collectives.testing MODULE:FUNCTION``: the whole property
  test in one call or command; ``pytest -p collectives.testing.plugin`` gives pytest fixtures.
"""

from .checks import Counterexample, assert_matches_reference, bitwise_equal, run_case
from .pool import WorkerPool
from .runner import property_test
from .strategies import COLLECTIVES, Case, cases, make_input

__all__ = [
    "COLLECTIVES",
    "Case",
    "Counterexample",
    "WorkerPool",
    "assert_matches_reference",
    "bitwise_equal",
    "cases",
    "make_input",
    "property_test",
    "run_case",
]
