"""Tools to property-test collectives — ours or your own — against torch's built-in ones.

* :class:`WorkerPool`: ``N`` ranks started once and reused for many test cases.
* :mod:`collectives.testing.strategies`: hypothesis strategies (:class:`Case`, :func:`cases`,
  dtypes, reduce ops, shapes, memory layouts) and :func:`make_input`.
* :mod:`collectives.testing.checks`: :func:`assert_matches_reference` runs a case on our
  collectives (or your ``impl``) and on torch's, and compares them exactly.
"""

from .checks import assert_matches_reference, bitwise_equal, compare_with_reference
from .pool import WorkerPool
from .strategies import Case, cases, make_input

__all__ = ["Case", "WorkerPool", "assert_matches_reference", "bitwise_equal", "cases", "compare_with_reference", "make_input"]
