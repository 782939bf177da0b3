"""Start a job: N local processes on 127.0.0.1, or one rank of a job started by torchrun / SLURM.

``launch(fn, world_size, *args)`` runs ``fn(rank, world_size, *args)`` on every rank with the
collectives already initialised, and returns the list of results (index = rank).

* **Local** (no rendezvous variables in the environment): the parent hosts the rendezvous store on
  127.0.0.1 with a free port chosen by the OS, spawns ``world_size`` processes that bind to the
  loopback interface only, and collects their results. If a rank raises, the others are stopped
  and the exception is re-raised here with the rank's traceback attached as a note. If a rank
  dies without a word (killed, segfault), :class:`LaunchError` names it and its exit code. No
  child outlives the launcher (children also die with their parent, via ``PR_SET_PDEATHSIG``).
* **torchrun / SLURM**: when ``RANK``, ``WORLD_SIZE`` and ``MASTER_ADDR`` are set (or
  ``SLURM_PROCID`` / ``SLURM_NTASKS`` with ``MASTER_ADDR``), this process is one rank: it joins
  through ``env://``, runs ``fn`` once and returns a list whose only filled entry is its own.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import multiprocessing as mp
import multiprocessing.connection
from multiprocessing import reduction
import os
import pickle
import signal
import sys
import time
import traceback
from typing import Any, Callable, NoReturn

import torch
import torch.distributed as dist

from . import procfs
from .backends import resolve_backend
from .errors import timeout_seconds
from .group import destroy_process_group, init_process_group

log = logging.getLogger(__name__)

_STORE_TIMEOUT = 1800.0  # seconds the rendezvous store waits when no timeout is given


class LaunchError(RuntimeError):
    """A rank died, a rank never joined, or the job ran past its time limit."""

    def __init__(self, message: str, failed_ranks: list[int] | None = None):
        super().__init__(message)
        self.failed_ranks = failed_ranks or []


def _from_environment() -> tuple[int, int] | None:
    env = os.environ
    if "MASTER_ADDR" not in env:
        return None
    if "RANK" in env and "WORLD_SIZE" in env:
        return int(env["RANK"]), int(env["WORLD_SIZE"])
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        env.setdefault("MASTER_PORT", "29500")
        return int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"])
    return None


def configure_logging(rank: int, level: int = logging.INFO) -> None:
    """Log records prefixed with the rank, e.g. ``[rank 1] INFO ddp.train: ...``."""
    logging.basicConfig(level=level, format=f"[rank {rank}] %(levelname)s %(name)s: %(message)s", force=True)


def launch(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str | None = None,
    timeout: datetime.timedelta | float | None = None,
    join_timeout: float | None = None,
    log_level: int | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks with collectives initialised.

    Args:
        fn: a picklable (module-level) function.
        backend: collectives backend (see :func:`collectives.init_process_group`). ``"sim"``
            runs the ranks as virtual ranks inside this process on a modelled network
            (:func:`collectives.sim.launch`, which also takes the network).
        timeout: deadline of every collective's waits, and of the rendezvous.
        join_timeout: stop everything and raise :class:`LaunchError` if the whole job takes longer.
        log_level: logging level of the children (default: this process's root level).
    """
    if not callable(fn):
        raise TypeError(f"launch: fn must be callable, got {type(fn).__name__}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"launch: world_size must be a positive int, got {world_size!r}")
    if backend is not None and resolve_backend(backend) == "sim":  # virtual ranks, in this process
        from .sim import launch as launch_virtual

        return launch_virtual(fn, world_size, *args, timeout=timeout)
    level = logging.getLogger().getEffectiveLevel() if log_level is None else log_level
    env_rank = _from_environment()
    if env_rank is not None:
        rank, size = env_rank
        results: list[Any] = [None] * size
        results[rank] = _run_env_rank(fn, rank, size, args, backend, timeout, level)
        return results
    return _launch_local(fn, world_size, args, backend, timeout, join_timeout, level)


def _run_env_rank(fn, rank, size, args, backend, timeout, level) -> Any:
    configure_logging(rank, level)
    init_process_group(backend, init_method="env://", timeout=timeout, world_size=size, rank=rank)
    try:
        return fn(rank, size, *args)
    finally:
        destroy_process_group()


#: modules a forkserver imports once, before it forks ranks: what every rank needs anyway
#: (``torch._dynamo``: every ``torch.optim`` optimizer imports it when built, ~1.5 s of CPU a
#: process that forked ranks, replacements and spares would each pay again).
_PRELOAD = ["torch", "torch._dynamo", "collectives"]
#: environment variable choosing how ranks start: ``forkserver`` (default) or ``spawn``.
START_METHOD_VARIABLE = "RINGDDP_START_METHOD"


def start_method() -> str:
    """How local ranks start: ``$RINGDDP_START_METHOD`` if set (``forkserver`` or ``spawn``),
    else ``forkserver`` where the platform has it, else ``spawn``."""
    chosen = os.environ.get(START_METHOD_VARIABLE, "")
    if chosen and chosen not in ("forkserver", "spawn"):
        raise ValueError(f"${START_METHOD_VARIABLE}={chosen!r}: use 'forkserver' or 'spawn'")
    return chosen or ("forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn")


def start_process(target: Callable[..., Any], args: tuple, name: str) -> mp.process.BaseProcess:
    """Start ``target(*args)`` in a new process, as every local rank starts.

    With ``forkserver`` (the default, see :func:`start_method`) a server process, started on
    first use and preloaded with torch (and ``torch._dynamo``, which optimizers import) and
    collectives, forks each new process: it starts in ~0.1 s instead of importing torch again
    (~2 s of CPU each, and ~1.5 s more to build an optimizer: on a loaded machine or with
    more ranks than cores, the slowest part of a short job). The new process still gets what
    a spawned one gets: a fresh interpreter state for ``target``'s module, this process's
    environment and its stdout/stderr as of this call (not the server's, which are those of its
    first use), ``OMP_NUM_THREADS`` applied, NumPy's global RNG freshly seeded (Python's
    ``random`` reseeds itself after a fork). ``spawn`` (``$RINGDDP_START_METHOD=spawn``) starts a
    new interpreter for every process. Arguments are pickled either way."""
    method = start_method()
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(_PRELOAD)
    p = ctx.Process(target=_enter, args=(dict(os.environ), _Stdio(), target, args), name=name)
    p.start()
    return p


class _Stdio:
    """The starting process's stdout and stderr, handed to the new process as file descriptors."""

    def __reduce__(self):
        return _Stdio._install, tuple(reduction.DupFd(fd) for fd in (1, 2))

    @staticmethod
    def _install(*dup_fds) -> None:
        for target, dup in zip((1, 2), dup_fds):
            fd = dup.detach()
            if fd != target:
                os.dup2(fd, target)
                os.close(fd)


def _enter(environment: dict[str, str], _stdio: None, target: Callable[..., Any], args: tuple) -> None:
    """A new process's first step (its stdout/stderr were installed while unpickling ``_stdio``)."""
    os.environ.clear()
    os.environ.update(environment)
    threads = environment.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))
    numpy = sys.modules.get("numpy")
    if numpy is not None:  # forked: the server's global NumPy RNG; a spawned process draws a fresh seed
        numpy.random.seed()
    target(*args)


def set_parent_death_signal() -> None:
    """Ask Linux to kill this process when its parent dies (no orphans after a crash)."""
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass


def join_local(rank: int, size: int, port: int, backend: str | None, timeout, level: int) -> None:
    """Initialise collectives in a locally spawned rank whose store is at 127.0.0.1:``port``."""
    set_parent_death_signal()
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # bind gloo to loopback only
    configure_logging(rank, level)
    seconds = timeout_seconds(timeout, _STORE_TIMEOUT)
    store = dist.TCPStore("127.0.0.1", port, size, is_master=False, timeout=datetime.timedelta(seconds=seconds))
    init_process_group(backend, timeout=timeout, world_size=size, rank=rank, store=store)


@dataclasses.dataclass
class Report:
    """What a rank tells its parent, sent as one pickled message.

    ``status`` is ``"ok"`` (``value`` holds the result), ``"ready"`` (a pool rank started),
    ``"error"`` (``error`` is the exception, or None if it cannot be pickled; ``traceback`` its
    text) or ``"died"`` (made up by the parent for a rank that exited silently; ``exitcode``).
    """

    status: str
    value: Any = None
    error: BaseException | None = None
    traceback: str = ""
    exitcode: int | None = None

    @classmethod
    def failure(cls, exc: BaseException) -> "Report":
        """An ``"error"`` report of ``exc``, being handled now."""
        tb = traceback.format_exc()
        try:
            pickle.dumps(exc)
        except Exception:  # noqa: BLE001 - any pickling failure: send the text only
            return cls("error", traceback=tb)
        return cls("error", error=exc, traceback=tb)

    def describe(self, rank: int) -> str:
        """One line: how rank ``rank`` failed."""
        if self.status == "died":
            code = self.exitcode
            how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
            return f"rank {rank} died without reporting ({how})"
        return f"rank {rank} raised {self.traceback.strip().splitlines()[-1]}"


def send_report(conn: mp.connection.Connection, report: Report) -> None:
    """Send a report to the parent by value.

    Plain pickle, not multiprocessing's: that one ships tensors as shared-memory handles, which
    die with this process, so a rank returning a tensor and exiting would look like a crash.
    """
    conn.send_bytes(pickle.dumps(report))


def read_report(conn: mp.connection.Connection, proc: mp.process.BaseProcess) -> Report:
    """The report of rank process ``proc``, or a ``"died"`` one if it exited without a word."""
    try:
        if conn.poll(0.5):
            return pickle.loads(conn.recv_bytes())
    except (EOFError, OSError):
        pass
    proc.join(5)
    return Report("died", exitcode=proc.exitcode)


def _child(fn, rank, size, args, backend, timeout, port, level, conn) -> None:
    try:
        join_local(rank, size, port, backend, timeout, level)
        try:
            result = fn(rank, size, *args)
        finally:
            destroy_process_group()
        send_report(conn, Report("ok", result))
    except BaseException as exc:  # report everything, then exit non-zero
        send_report(conn, Report.failure(exc))
        conn.close()
        os._exit(1)
    conn.close()


def start_store(size: int, timeout: datetime.timedelta | float | None) -> dist.TCPStore:
    """The rendezvous store, hosted by this process on 127.0.0.1 with an OS-chosen free port."""
    return dist.TCPStore(
        "127.0.0.1", 0, size, is_master=True, wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout_seconds(timeout, _STORE_TIMEOUT)),
    )


def _launch_local(fn, size, args, backend, timeout, join_timeout, level) -> list[Any]:
    seconds = timeout_seconds(timeout)
    store = start_store(size, timeout)
    procs, conns = [], []
    for rank in range(size):
        parent_end, child_end = mp.Pipe(duplex=False)
        p = start_process(_child, (fn, rank, size, args, backend, timeout, store.port, level, child_end),
                          f"ringddp-rank{rank}")
        child_end.close()
        procs.append(p)
        conns.append(parent_end)
    results: list[Any] = [None] * size
    reported: dict[int, Report] = {}
    failures: list[tuple[int, Report]] = []  # in order of arrival
    deadline = None if join_timeout is None else time.monotonic() + join_timeout
    grace = None  # once a rank failed, the others get this long to notice and stop
    try:
        while len(reported) < size:
            now = time.monotonic()
            limit = min(t for t in (deadline, grace) if t is not None) if (deadline or grace) else None
            if limit is not None and now >= limit:
                break
            pending = [r for r in range(size) if r not in reported]
            if grace is not None and all(is_stopped(procs[r]) for r in pending):
                break  # the rest are stopped (SIGSTOP, a debugger): they cannot notice the failure
            waitables = [conns[r] for r in pending] + [procs[r].sentinel for r in pending]
            wait = None if limit is None else max(0.0, limit - now)
            if grace is not None:
                wait = min(wait, 0.2)  # look for stopped ranks now and then
            ready = mp.connection.wait(waitables, wait)
            for rank in range(size):
                if rank in reported:
                    continue
                if conns[rank] in ready or procs[rank].sentinel in ready:
                    report = read_report(conns[rank], procs[rank])
                    reported[rank] = report
                    if report.status == "ok":
                        results[rank] = report.value
                    else:
                        failures.append((rank, report))
                        if grace is None:
                            grace = time.monotonic() + grace_seconds(seconds)
    finally:
        # Ranks that reported success are finishing their interpreter shutdown: let them.
        stop_ranks(procs, exit_grace=5.0 if len(reported) == size and not failures else 0.0)
        store = None
    missing = [r for r in range(size) if r not in reported]
    if not failures and not missing:
        return results
    raise_failure(failures, missing, join_timeout if deadline and not failures else None)


def grace_seconds(timeout: float | None) -> float:
    return 15.0 if timeout is None else min(15.0, timeout + 5.0)


def is_stopped(proc: mp.process.BaseProcess) -> bool:
    """Whether ``proc`` is stopped (SIGSTOP, traced): it runs nothing until continued."""
    return procfs.state(proc.pid) in ("T", "t")


def stop_ranks(procs: list[mp.process.BaseProcess], exit_grace: float = 0.0) -> None:
    """Stop every rank: wait up to ``exit_grace`` seconds for a clean exit, then terminate, then kill.

    A stopped rank is continued after SIGTERM, so that it acts on it at once.
    """
    deadline = time.monotonic() + exit_grace
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
            if is_stopped(p):
                os.kill(p.pid, signal.SIGCONT)
    for p in procs:
        p.join(5)
        if p.is_alive():
            p.kill()
            p.join()


def raise_failure(failures: list[tuple[int, Report]], missing: list[int], timed_out: float | None) -> NoReturn:
    """Raise the first failed rank's exception (with every rank's fate attached), else :class:`LaunchError`.

    ``failures``: (rank, report) in the order they arrived; ``missing``: ranks that never
    reported; ``timed_out``: the join timeout that stopped them, if that is why.
    """
    lines = [report.describe(rank) for rank, report in failures]
    if missing:
        lines.append(f"ranks {missing} were stopped" + (f" after the {timed_out}s join timeout" if timed_out else ""))
    summary = "; ".join(lines)
    first_rank, first = failures[0] if failures else (None, None)
    if first is not None and first.error is not None:
        _add_note(first.error, f"[launch] {summary}\n[launch] traceback of rank {first_rank}:\n{first.traceback}")
        raise first.error
    detail = f"\ntraceback of rank {first_rank}:\n{first.traceback}" if first and first.status == "error" else ""
    raise LaunchError(f"launch failed: {summary}{detail}", [rank for rank, _ in failures] or missing)


def _add_note(exc: BaseException, note: str) -> None:
    """``exc.add_note(note)``; on Python 3.10, which has no notes, append it to the message."""
    if hasattr(exc, "add_note"):
        exc.add_note(note)
    elif exc.args and isinstance(exc.args[0], str):
        exc.args = (f"{exc.args[0]}\n{note}", *exc.args[1:])
