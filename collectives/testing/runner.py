"""Property-test a collective in one call, or one command.

    python -m collectives.testing examples.ring_all_reduce:ring_all_reduce --collective all_reduce \\
        --world-size 4 --ops sum --dtypes float32 --examples 200

draws cases (:func:`~collectives.testing.strategies.cases`, narrowed by the options), runs each
on the function and on torch's built-in on real processes, checks every rank's tensors against
a hand-computed expectation, and on failure prints hypothesis' shrunk counterexample (the case,
inputs per rank, expected, got) and exits with status 1; 0 when every example passed.
``ours`` instead of ``MODULE:FUNCTION`` tests this package's own collectives.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from typing import Any, Callable, Iterable

from hypothesis import HealthCheck, given, settings
from hypothesis import seed as fixed_seed

from ..sizes import parse_size
from .checks import Counterexample, assert_matches_reference
from .pool import WorkerPool
from .strategies import COLLECTIVES, DEFAULT_MAX_BYTES, LAYOUTS, cases


def property_test(
    impl: Callable[..., Any] | None,
    collectives: str | Iterable[str] = "all_reduce",
    world_sizes: int | Iterable[int] = 4,
    *,
    examples: int = 100,
    seed: int | None = None,
    pools: Callable[[int], WorkerPool] | None = None,
    backend: str = "p2p",
    timeout: float = 20.0,
    **filters: Any,
) -> int:
    """Property-test ``impl`` (torch's signature; ``None``: our collectives) against torch's built-in.

    Draws ``examples`` cases from :func:`cases` (``filters`` are its keyword filters: ``ops``,
    ``dtypes``, ``min_bytes``, ``max_bytes``, ``layouts``, ``roots``, ``uneven``, ``algorithms``)
    and raises the shrunk :class:`Counterexample` on failure. ``pools(n)`` supplies pools (e.g.
    the pytest fixture); by default pools of ``backend`` are started here and closed at the end.
    ``timeout`` bounds every wait inside the ranks (seconds). Returns the number of examples run.
    """
    names = (collectives,) if isinstance(collectives, str) else tuple(collectives)
    if impl is not None:
        filters.setdefault("algorithms", ["auto"])  # our algorithm choice means nothing to impl
    started: dict[int, WorkerPool] = {}

    def get(n: int) -> WorkerPool:
        if pools is not None:
            return pools(n)
        if n not in started:
            started[n] = WorkerPool(n, backend=backend, timeout=timeout, job_timeout=3 * timeout + 30)
        return started[n]

    ran = []

    @settings(max_examples=examples, deadline=None, database=None, report_multiple_bugs=False,
              suppress_health_check=list(HealthCheck))
    @given(case=cases(world_sizes, names, **filters))
    def check(case):
        ran.append(case)
        assert_matches_reference(get, case, impl)

    if seed is not None:
        check = fixed_seed(seed)(check)
    try:
        check()
    finally:
        for pool in started.values():
            pool.close()
    return len(ran)


def load(target: str) -> Callable[..., Any] | None:
    """``"package.module:function"`` -> the function (``"ours"`` -> None: our collectives)."""
    if target == "ours":
        return None
    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        raise ValueError(f"expected MODULE:FUNCTION (e.g. examples.ring_all_reduce:ring_all_reduce), got {target!r}")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise TypeError(f"{target} is not callable")
    return obj


def _csv(text: str) -> list[str]:
    return [x for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m collectives.testing", description=__doc__.split("\n\n")[0],
                                epilog="example: python -m collectives.testing examples.ring_all_reduce:ring_all_reduce "
                                       "--collective all_reduce --world-size 4 --ops sum")
    p.add_argument("target", help="MODULE:FUNCTION with torch's signature for the collective, or 'ours'")
    p.add_argument("--collective", default="all_reduce", help=f"comma list of {','.join(COLLECTIVES)}")
    p.add_argument("--world-size", default="4", help="comma list of world sizes (default 4)")
    p.add_argument("--ops", help="comma list of sum,product,min,max,avg (default all)")
    p.add_argument("--dtypes", help="comma list like float32,int64,bool (default all supported)")
    p.add_argument("--examples", type=int, default=100)
    p.add_argument("--min-bytes", type=parse_size, default=0)
    p.add_argument("--max-bytes", type=parse_size, default=DEFAULT_MAX_BYTES,
                   help=f"largest tensor per rank, e.g. 8M (default {DEFAULT_MAX_BYTES})")
    p.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma list of {','.join(LAYOUTS)}")
    p.add_argument("--roots", help="comma list of allowed roots (default all ranks)")
    split = p.add_mutually_exclusive_group()
    split.add_argument("--uneven", dest="uneven", action="store_true", default=None, help="all-to-all: only unequal pieces")
    split.add_argument("--even", dest="uneven", action="store_false", help="all-to-all: only equal pieces")
    p.add_argument("--seed", type=int, help="hypothesis seed (reproduce a run)")
    p.add_argument("--timeout", type=float, default=20.0, help="deadline of every wait in the ranks, seconds")
    p.add_argument("--backend", default="p2p", help="backend of the ranks' default group (what 'ours' tests)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    try:
        impl = load(args.target)
        filters: dict[str, Any] = {
            "min_bytes": args.min_bytes, "max_bytes": args.max_bytes, "layouts": _csv(args.layouts), "uneven": args.uneven,
        }  # fmt: skip
        if args.ops:
            filters["ops"] = _csv(args.ops)
        if args.dtypes:
            filters["dtypes"] = _csv(args.dtypes)
        if args.roots:
            filters["roots"] = [int(r) for r in _csv(args.roots)]
        sizes = [int(n) for n in _csv(args.world_size)]
        names = _csv(args.collective)
        cases(sizes, names, **filters)  # bad filters fail here, before any process starts
    except (ImportError, AttributeError, TypeError, ValueError) as exc:
        p.error(str(exc))
    try:
        ran = property_test(impl, names, sizes, examples=args.examples, seed=args.seed, backend=args.backend,
                            timeout=args.timeout, **filters)
    except Counterexample as exc:
        print(f"\nFAILED: {args.target}\n{exc}")
        return 1
    print(f"OK: {args.target} passed {ran} examples ({','.join(names)}; world sizes {','.join(map(str, sizes))})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
