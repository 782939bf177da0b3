"""Mutant check: prove that the tests fail when a documented promise is broken.

    python scripts/mutants.py              # every mutant (about 7 minutes on 2 busy cores)
    python scripts/mutants.py --list       # the mutants, the promise each breaks, its tests
    python scripts/mutants.py shm-dead-peer-unnoticed p2p-deadline-ignored   # some of them

The working tree is copied to a temporary directory (without .git, .venv and caches). There,
one at a time, each mutant replaces one exact piece of the library's source with a small
breakage of a promise in README.md or docs/DESIGN.md, and the tests that stand for that promise
run with this interpreter, the copy first on PYTHONPATH (spawned rank processes inherit it and
import the mutated copy: the ``canary`` mutant, which breaks only rank processes, proves it).
A mutant is *killed* when one of those tests fails (pytest stops at the first: a mutant that turns
a fast failure into a wait for a deadline would otherwise wait once per test); it *survives* when
they pass. Before the mutants, the same tests run on the unmutated copy and must pass, so that a
kill means something.

Each mutant's source anchor must occur exactly once in its file: when a refactor moves the code,
this script stops with an error naming the mutant instead of silently testing nothing. An anchor
that still matches can still stop mattering (code added above it returns first: the mutant then
changes nothing, and "survived" or "killed" would say nothing about the tests), so each mutant's
replacement text calls ``MUTANT_REACHED()`` where its edit runs. In the copy that call becomes one
into a small module written beside the tree, which appends the process id to a marker file, once
per process, in the test process or any rank process it spawned. A mutant whose marker is missing
after its tests is reported ``NOT REACHED``: an error, neither killed nor survived.
``tests/test_mutants.py`` checks every anchor and marker in the suite, and runs the marker on the
canary and on one edit the tests cannot reach (under a minute).

Exit status: 0 when every mutant is killed; 1 naming the survivors (and the ones that ran out of
time: each run is limited to ``--limit`` seconds, default 60); 2 when an anchor or a marker is
missing, a mutant's edit was never executed (NOT REACHED), or the unmutated tests fail.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
IGNORED = (".git", ".venv", "venv", "__pycache__", ".pytest_cache", ".hypothesis", "*.egg-info", ".mypy_cache")
REACHED = "MUTANT_REACHED()"  # in a mutant's new text: where its edit runs
MARK_MODULE = "ringddp_mutant_mark"  # written at the copy's root, which is first on PYTHONPATH
MARK_FILE = ".mutant-reached"  # beside it: one line per process that ran the edit
MARK_SOURCE = f'''"""Written by scripts/mutants.py: the mutated code calls reached() where its edit runs."""
import os

_path = os.path.join(os.path.dirname(os.path.abspath(__file__)), {MARK_FILE!r})
_marked = None


def reached():
    """Append this process's id to the marker file, once per process; never raise (a failure
    here must not kill a mutant: a missing marker is reported instead)."""
    global _marked
    if _marked != os.getpid():
        try:
            with open(_path, "a") as f:
                f.write(f"{{os.getpid()}}\\n")
            _marked = os.getpid()
        except OSError:
            pass
'''


@dataclasses.dataclass(frozen=True)
class Mutant:
    name: str
    promise: str  # what the docs say, which this mutant breaks
    path: str  # file, relative to the repository root
    old: str  # exact text, found exactly once
    new: str  # calls MUTANT_REACHED() (REACHED) once, where the edit runs
    tests: tuple[str, ...]  # pytest node ids that must fail


MUTANTS = (
    Mutant(
        "canary",
        "(not a promise) rank processes import the mutated copy: every spawned rank fails to start",
        "collectives/launch.py",
        '    """Initialise collectives in a locally spawned rank whose store is at 127.0.0.1:``port``."""\n'
        "    set_parent_death_signal()\n",
        '    """Initialise collectives in a locally spawned rank whose store is at 127.0.0.1:``port``."""\n'
        "    MUTANT_REACHED()\n"
        '    raise RuntimeError("MUTANT canary: this rank runs the mutated copy")\n',
        ("tests/collectives/test_launch.py::test_results_by_rank_and_reraised_exceptions",),
    ),
    Mutant(
        "shm-dead-peer-unnoticed",
        "DESIGN, shm Waiting: the peer sockets reach EOF when a peer dies, even by SIGKILL: the waiter "
        "raises CollectiveError naming the op and the dead peer",
        "collectives/transport/shm/waiting.py",
        "        self._dead.add(q)  # EOF or reset: the peer's process is gone\n",
        "        MUTANT_REACHED()  # MUTANT: EOF ignored, the peer is never counted dead\n",
        ("tests/collectives/test_errors.py::test_dead_peer_makes_the_others_fail_fast[shm]",
         "tests/collectives/test_shm.py::test_rank_killed_or_stopped_mid_collective[SIGKILL]",
         "tests/collectives/test_faults.py::test_rank_killed_mid_all_reduce[shm]"),
    ),
    Mutant(
        "p2p-dead-peer-unnoticed",
        "README, No hangs: a dead peer raises CollectiveError naming the collective and the peer rank",
        "collectives/transport/torch_p2p.py",
        "        except RuntimeError as exc:\n"
        "            raise self._transport.error(exc, self._kind, self._peer) from exc\n",
        "        except RuntimeError as exc:\n"
        "            MUTANT_REACHED()\n"
        "            import time; time.sleep(self._transport.timeout)  # MUTANT: a failure is noticed at the deadline\n"
        '            raise self._transport.error(RuntimeError("Timed out (mutant)"), self._kind, self._peer) from exc\n',
        ("tests/collectives/test_errors.py::test_dead_peer_makes_the_others_fail_fast[p2p]",
         "tests/collectives/test_errors.py::test_point_to_point_waits_have_deadlines_and_see_dead_peers[p2p]"),
    ),
    Mutant(
        "shm-deadline-ignored",
        "README, No hangs: every wait has a deadline; a timeout raises CollectiveTimeoutError naming the "
        "collective and the peer",
        "collectives/transport/shm/waiting.py",
        "        deadline = time.monotonic() + self.timeout\n",
        "        MUTANT_REACHED()\n        deadline = time.monotonic() + 1000 * self.timeout  # MUTANT\n",
        ("tests/collectives/test_errors.py::test_peer_that_never_sends_times_out_with_a_clear_error[shm]",),
    ),
    Mutant(
        "p2p-deadline-ignored",
        "README, No hangs: every wait has a deadline (collectives, recv, irecv().wait(), recv_object_list)",
        "collectives/transport/torch_p2p.py",
        "        self.wait_timeout = datetime.timedelta(seconds=timeout)\n",
        "        MUTANT_REACHED()\n        self.wait_timeout = datetime.timedelta(seconds=1000 * timeout)  # MUTANT\n",
        ("tests/collectives/test_errors.py::test_peer_that_never_sends_times_out_with_a_clear_error[p2p]",
         "tests/collectives/test_errors.py::test_point_to_point_waits_have_deadlines_and_see_dead_peers[p2p]"),
    ),
    Mutant(
        "group-not-marked-broken",
        "README, No hangs: after a timeout or a dead peer the group is unusable and says so",
        "collectives/group.py",
        "        if self._failure is None:\n            self._failure = error\n",
        "        if self._failure is None:\n            MUTANT_REACHED()  # MUTANT: the group never learns it failed\n",
        ("tests/collectives/test_errors.py::test_dead_peer_makes_the_others_fail_fast[shm]",
         "tests/collectives/test_errors.py::test_peer_that_never_sends_times_out_with_a_clear_error[p2p]"),
    ),
    Mutant(
        "shm-segment-never-released",
        "DESIGN, shm Segments: the segments stay mapped until the transport closes (then nothing holds "
        "them: no fd, no mapping)",
        "collectives/transport/shm/rendezvous.py",
        "            for f in {fd, *fds.values()}:\n                os.close(f)\n",
        "            for f in {fd, *fds.values()}:\n                MUTANT_REACHED()  # MUTANT: the segments' fds are never closed\n",
        ("tests/collectives/test_shm.py::test_segments_are_released_when_the_group_is_destroyed",),
    ),
    Mutant(
        "p2p-wire-check-skipped",
        "README, mismatched calls: at the default level (CHECK) a mismatch raises a CollectiveError on "
        "every rank describing both calls (gloo tags and the header exchange)",
        "collectives/transport/torch_p2p.py",
        "            if header is None or self.world_size == 1:\n",
        "            if MUTANT_REACHED() or True:  # MUTANT: every collective runs unchecked\n",
        ("tests/collectives/test_faults.py::test_default_level_turns_a_size_mismatch_into_a_collective_error",
         "tests/collectives/test_misuse.py::test_named_mismatches_raise_collective_error_on_every_rank[p2p]"),
    ),
    Mutant(
        "shm-wire-check-skipped",
        "DESIGN, shm Mismatches: each slot carries its message's tag and every rank compares headers, "
        "so data of another call is never read: the receiver raises",
        "collectives/transport/shm/wirecheck.py",
        '        numbered and, once attached, published."""\n        if header is None:\n',
        '        numbered and, once attached, published."""\n        if MUTANT_REACHED() or True:  # MUTANT: every collective runs unchecked\n',
        ("tests/collectives/test_shm.py::test_wire_check_names_both_calls_without_a_message_of_its_own[dtype over messages]",
         "tests/collectives/test_faults.py::test_mismatch_at_more_than_three_ranks[shm]"),
    ),
    Mutant(
        "shm-one-shot-order-differs-on-one-rank",
        "README: all_reduce is bitwise identical on every rank, also for floating-point sums (every rank "
        "folds the regions in rank order)",
        "collectives/shm_algorithms.py",
        "    _reduce_into(op, buf, operands)\n",
        "    MUTANT_REACHED()\n"
        "    _reduce_into(op, buf, operands[::-1] if r == 1 else operands)  # MUTANT\n",
        # the Python fold is the reference beside the native kernel: test_native's 3 ranks run it on rank 1
        ("tests/collectives/test_shm.py::test_float_sums_are_bitwise_identical_and_in_rank_order[3]",
         "tests/collectives/test_native.py::test_native_one_shot_gives_the_python_paths_bits_and_meets_it[3-python_ranks1]"),
    ),
    Mutant(
        "shm-two-shot-slice-in-reverse-order",
        "DESIGN, shm_algorithms: rank r combines slice r of every rank in rank order 0, 1, ..., n-1 (the "
        "result is still identical on every rank: only a torch-computed fold notices)",
        "collectives/shm_algorithms.py",
        "            operands = [piece[a:b] if q == r else regions.view(q, h, buf.dtype, b)[a:b] for q in everyone]\n",
        "            MUTANT_REACHED()\n"
        "            operands = [piece[a:b] if q == r else regions.view(q, h, buf.dtype, b)[a:b]\n"
        "                        for q in (reversed(everyone) if r == 1 else everyone)]  # MUTANT\n",
        ("tests/collectives/test_shm.py::test_float_sums_are_bitwise_identical_and_in_rank_order[3]",),
    ),
    Mutant(
        "planned-call-of-another-dtype",
        "DESIGN §3, the plain call's planned path: a call runs the plan made for its own device, dtype, "
        "count and op only (what the checks it skips depend on); the wire check still compares the calls",
        "collectives/api.py",
        "            key, state = (tensor.is_cpu, tensor.dtype, tensor.numel(), op), (debug.level(), g.tuning.key())\n",
        "            MUTANT_REACHED()\n"
        "            key, state = (tensor.is_cpu, torch.float32, tensor.numel(), op), (debug.level(), g.tuning.key())  # MUTANT\n",
        ("tests/collectives/test_shm.py::test_planned_plain_calls_keep_their_checks_and_the_wire_check",),
    ),
    Mutant(
        "zero-shrink-cuts-momentum-wrong",
        "DESIGN §5, shrink with ZeRO-1/2: the survivors cut the optimizer shards again for the smaller "
        "world, moving bits only (each parameter's state put back together from its pieces)",
        "ddp/zero/replica.py",
        "                    whole[piece.start : piece.stop] = v.reshape(-1)\n",
        "                    MUTANT_REACHED()\n"
        "                    whole[piece.start : piece.stop] = v.reshape(-1).flip(0)  # MUTANT\n",
        ("tests/ddp/test_zero.py::test_shard_replica_stays_bitwise_equal_to_its_owner_and_shards_cut_for_other_worlds",),
    ),
    Mutant(
        "single-copy-never-used",
        "README: large broadcast/scatter/... transfers copy once, straight from the owner's tensor, with "
        "process_vm_readv where the set-up probe finds it allowed (the probe's flag stays on here)",
        "collectives/shm_algorithms.py",
        "    return regions.cma and nbytes >= CMA_BYTES[op]\n",
        "    MUTANT_REACHED()\n    return False  # MUTANT: always through the regions\n",
        ("tests/collectives/test_shm_cma.py::test_large_transfers_are_read_with_process_vm_readv",),
    ),
    Mutant(
        "non-contiguous-write-back-dropped",
        "README, Every shape: non-contiguous views are handled through a contiguous copy",
        "collectives/api.py",
        "        if kind is None and self.write_back and not t.is_contiguous():\n            t.copy_(self.flat.view_as(t))\n",
        "        if kind is None and self.write_back and not t.is_contiguous():\n            MUTANT_REACHED()  # MUTANT: the result stays in the copy\n",
        ("tests/collectives/test_misuse.py::test_requires_grad_tensors_are_accepted_like_torch",),
    ),
    Mutant(
        "subgroup-runs-on-the-world",
        "README: collectives on subgroups (new_group) involve the group's ranks only",
        "collectives/group.py",  # member(): every collective, async or not, finds its group there
        "    if isinstance(group, Group):  # the common case first: one check\n        return group\n",
        "    if isinstance(group, Group):  # the common case first: one check\n        MUTANT_REACHED()\n"
        "        return get_default_group()  # MUTANT: every collective runs on the default group\n",
        ("tests/collectives/test_all_reduce.py::test_subgroups",
         "tests/collectives/test_groups.py::test_overlapping_async_subgroups"),
    ),
    Mutant(
        "launcher-no-grace-period",
        "DESIGN, the launcher: when a rank raises, the others get a short grace period to notice",
        "collectives/launch.py",
        "    return 15.0 if timeout is None else min(15.0, timeout + 5.0)\n",
        "    MUTANT_REACHED()\n    return 0.0  # MUTANT\n",
        ("tests/collectives/test_faults.py::test_launcher_grants_the_other_ranks_a_grace_period[running]",),
    ),
)


def copy_tree(dest: Path) -> None:
    """The working tree without the ignored paths, and the marker module at its root."""
    shutil.copytree(ROOT, dest, ignore=shutil.ignore_patterns(*IGNORED), symlinks=True)
    (dest / f"{MARK_MODULE}.py").write_text(MARK_SOURCE)


def environment(copy: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(copy), *filter(None, [env.get("PYTHONPATH")])])
    env["PYTHONDONTWRITEBYTECODE"] = "1"  # no cached bytecode can outlive a mutation
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def run_tests(copy: Path, tests: tuple[str, ...], limit: float) -> tuple[str, float, str]:
    """Run ``tests`` in ``copy``: ("passed" | "failed" | "error" | "timeout", seconds, output)."""
    # -x: the first failure kills a mutant, no need to wait out the others' deadlines
    argv = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-rfE", *tests]
    start = time.monotonic()
    proc = subprocess.Popen(argv, cwd=copy, env=environment(copy), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=limit)
        status = {0: "passed", 1: "failed"}.get(proc.returncode, "error")
    except subprocess.TimeoutExpired:
        status, out = "timeout", ""
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # pytest, its launchers and their ranks
        except OSError:
            pass
        proc.wait()
    return status, time.monotonic() - start, out or ""


def failed_tests(output: str) -> list[str]:
    return re.findall(r"^(?:FAILED|ERROR) (.+?)(?: - .*)?$", output, flags=re.M)


def check_anchors(tree: Path, mutants: list[Mutant]) -> list[str]:
    """What keeps ``mutants`` from running in ``tree``: an anchor found other than exactly once,
    or a replacement that does not call ``MUTANT_REACHED()`` exactly once."""
    problems = []
    for m in mutants:
        text = (tree / m.path).read_text()
        count = text.count(m.old)
        if count != 1:
            problems.append(f"{m.name}: its anchor occurs {count} times in {m.path} (expected exactly once): {m.old!r}")
        if m.new.count(REACHED) != 1:
            problems.append(f"{m.name}: its new text must call {REACHED} once, where the edit runs")
    return problems


def mutated(text: str, m: Mutant) -> str:
    """``text`` with ``m``'s edit, its marker calling the marker module."""
    return text.replace(m.old, m.new.replace(REACHED, f"__import__({MARK_MODULE!r}).reached()"), 1)


def run_mutants(mutants: list[Mutant], limit: float = 60.0, baseline: bool = True) -> int:
    """Run ``mutants`` (module docstring) in a fresh copy of the tree; print a row each and the
    summary; return the exit status."""
    copy = Path(tempfile.mkdtemp(prefix="ringddp-mutants-")) / "tree"
    try:
        copy_tree(copy)
        problems = check_anchors(copy, mutants)
        if problems:
            print("mutants.py: anchors or markers missing (the code moved: update the mutants):", *problems, sep="\n  ")
            return 2
        where = subprocess.run([sys.executable, "-c", "import collectives, tests; print(collectives.__file__)"],
                               cwd=copy, env=environment(copy), capture_output=True, text=True)
        if not where.stdout.startswith(str(copy)):
            print(f"mutants.py: the copy's collectives is not the one imported: {where.stdout}{where.stderr}")
            return 2
        every_test = tuple(dict.fromkeys(t for m in mutants for t in m.tests))
        if baseline:
            status, seconds, out = run_tests(copy, every_test, max(limit, 30.0 * len(every_test)))
            print(f"baseline (no mutant): {len(every_test)} tests {status} in {seconds:.0f} s", flush=True)
            if status != "passed":
                print(out[-5000:])
                print("mutants.py: the tests fail without a mutant; nothing can be concluded")
                return 2
        rows = []
        width = max(len(m.name) for m in mutants)
        marker = copy / MARK_FILE
        print(f"{'mutant':<{width}}  {'result':<11} {'seconds':>7}  {'reached in':<12} tests that failed (of those run)",
              flush=True)
        for m in mutants:
            target = copy / m.path
            original = target.read_text()
            marker.unlink(missing_ok=True)
            target.write_text(mutated(original, m))
            try:
                status, seconds, out = run_tests(copy, m.tests, limit)
            finally:
                target.write_text(original)
            processes = len(set(marker.read_text().split())) if marker.exists() else 0
            result = {"failed": "killed", "passed": "SURVIVED", "timeout": "TIMEOUT", "error": "ERROR"}[status]
            if not processes:
                result = "NOT REACHED"  # the edit never ran: neither a kill nor a survival says anything
            shown = failed_tests(out) if status == "failed" else list(m.tests)
            short = ", ".join(t.split("::", 1)[-1] for t in shown)
            reached = f"{processes} process{'' if processes == 1 else 'es'}"
            print(f"{m.name:<{width}}  {result:<11} {seconds:7.1f}  {reached:<12} {short}", flush=True)
            if status == "error":
                print(out[-3000:])
            rows.append((m, result))
        not_killed = [m.name for m, result in rows if result != "killed"]
        print(f"\n{len(rows) - len(not_killed)} of {len(rows)} mutants killed")
        unreached = [m.name for m, result in rows if result == "NOT REACHED"]
        if unreached:
            print("NOT REACHED (the edit never ran: move the anchor to code the tests execute):", ", ".join(unreached))
            return 2
        if not_killed:
            print("not killed:", ", ".join(not_killed))
            return 1
        return 0
    finally:
        shutil.rmtree(copy.parent, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("names", nargs="*", help="mutants to run (default: all)")
    p.add_argument("--list", action="store_true", help="list the mutants and exit")
    p.add_argument("--limit", type=float, default=60.0, help="seconds each run of tests may take (default 60)")
    p.add_argument("--no-baseline", action="store_true", help="skip running the tests on the unmutated copy")
    args = p.parse_args(argv)
    known = {m.name: m for m in MUTANTS}
    unknown = [n for n in args.names if n not in known]
    if unknown:
        p.error(f"unknown mutants {unknown}; known: {', '.join(known)}")
    mutants = [known[n] for n in args.names] if args.names else list(MUTANTS)
    if args.list:
        for m in mutants:
            print(f"{m.name}\n  breaks: {m.promise}\n  in:     {m.path}\n  tests:  {' '.join(m.tests)}")
        return 0
    return run_mutants(mutants, args.limit, not args.no_baseline)


if __name__ == "__main__":
    sys.exit(main())
