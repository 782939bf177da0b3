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

import datetime
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import signal
import sys
import time
import traceback
from typing import Any, Callable

log = logging.getLogger(__name__)


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
        backend: collectives backend (see :func:`collectives.init_process_group`).
        timeout: deadline of every collective's waits, and of the rendezvous.
        join_timeout: stop everything and raise :class:`LaunchError` if the whole job takes longer.
        log_level: logging level of the children (default: this process's root level).
    """
    if not callable(fn):
        raise TypeError(f"launch: fn must be callable, got {type(fn).__name__}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"launch: world_size must be a positive int, got {world_size!r}")
    level = logging.getLogger().getEffectiveLevel() if log_level is None else log_level
    env_rank = _from_environment()
    if env_rank is not None:
        rank, size = env_rank
        results: list[Any] = [None] * size
        results[rank] = _run_env_rank(fn, rank, size, args, backend, timeout, level)
        return results
    return _launch_local(fn, world_size, args, backend, timeout, join_timeout, level)


def _run_env_rank(fn, rank, size, args, backend, timeout, level) -> Any:
    from .group import destroy_process_group, init_process_group

    configure_logging(rank, level)
    init_process_group(backend, init_method="env://", timeout=timeout, world_size=size, rank=rank)
    try:
        return fn(rank, size, *args)
    finally:
        destroy_process_group()


def _set_parent_death_signal() -> None:
    """Ask Linux to kill this process when its parent dies (no orphans after a crash)."""
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass


def join_local(rank: int, size: int, port: int, backend: str | None, timeout, level: int) -> None:
    """Initialise collectives in a locally spawned rank whose store is at 127.0.0.1:``port``."""
    _set_parent_death_signal()
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # bind gloo to loopback only
    import torch.distributed as dist

    from .group import init_process_group

    configure_logging(rank, level)
    seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout
    store = dist.TCPStore("127.0.0.1", port, size, is_master=False, timeout=datetime.timedelta(seconds=seconds or 1800))
    init_process_group(backend, timeout=timeout, world_size=size, rank=rank, store=store)


def send_report(conn, report: tuple) -> None:
    """Send a report to the parent by value.

    Plain pickle, not multiprocessing's: that one ships tensors as shared-memory handles, which
    die with this process, so a rank returning a tensor and exiting would look like a crash.
    """
    conn.send_bytes(pickle.dumps(report))


def read_report(conn) -> tuple:
    return pickle.loads(conn.recv_bytes())


def error_report(exc: BaseException) -> tuple:
    """A picklable ("error", exception-or-None, traceback text) report of ``exc``."""
    tb = traceback.format_exc()
    try:
        pickle.dumps(exc)
        return ("error", exc, tb)
    except Exception:
        return ("error", None, tb)


def _child(fn, rank, size, args, backend, timeout, port, level, conn) -> None:
    from .group import destroy_process_group

    try:
        join_local(rank, size, port, backend, timeout, level)
        try:
            result = fn(rank, size, *args)
        finally:
            destroy_process_group()
        send_report(conn, ("ok", result))
    except BaseException as exc:  # report everything, then exit non-zero
        send_report(conn, error_report(exc))
        conn.close()
        os._exit(1)
    conn.close()


def start_store(size: int, timeout) -> "dist.TCPStore":
    """The rendezvous store, hosted by this process on 127.0.0.1 with an OS-chosen free port."""
    import torch.distributed as dist

    seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout
    return dist.TCPStore(
        "127.0.0.1", 0, size, is_master=True, wait_for_workers=False,
        timeout=datetime.timedelta(seconds=seconds or 1800),
    )


def _launch_local(fn, size, args, backend, timeout, join_timeout, level) -> list[Any]:
    seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout
    store = start_store(size, timeout)
    ctx = mp.get_context("spawn")
    procs, conns = [], []
    for rank in range(size):
        parent_end, child_end = ctx.Pipe(duplex=False)
        p = ctx.Process(
            target=_child,
            args=(fn, rank, size, args, backend, timeout, store.port, level, child_end),
            name=f"ringddp-rank{rank}",
        )
        p.start()
        child_end.close()
        procs.append(p)
        conns.append(parent_end)
    results: list[Any] = [None] * size
    reported: dict[int, tuple] = {}
    failures: list[tuple[float, int, tuple]] = []  # (when, rank, report)
    deadline = None if join_timeout is None else time.monotonic() + join_timeout
    grace = None  # once a rank failed, the others get this long to notice and stop
    try:
        while len(reported) < size:
            now = time.monotonic()
            limit = min(t for t in (deadline, grace) if t is not None) if (deadline or grace) else None
            if limit is not None and now >= limit:
                break
            waitables = [conns[r] for r in range(size) if r not in reported]
            waitables += [procs[r].sentinel for r in range(size) if r not in reported]
            ready = mp.connection.wait(waitables, None if limit is None else max(0.0, limit - now))
            for rank in range(size):
                if rank in reported:
                    continue
                if conns[rank] in ready or procs[rank].sentinel in ready:
                    report = _read_report(conns[rank], procs[rank])
                    reported[rank] = report
                    if report[0] == "ok":
                        results[rank] = report[1]
                    else:
                        failures.append((time.monotonic(), rank, report))
                        if grace is None:
                            grace = time.monotonic() + _grace_seconds(seconds)
    finally:
        # Ranks that reported success are finishing their interpreter shutdown: let them.
        _stop(procs, exit_grace=5.0 if len(reported) == size and not failures else 0.0)
        store = None
    missing = [r for r in range(size) if r not in reported]
    if not failures and not missing:
        return results
    _raise_failure(failures, missing, join_timeout if deadline and not failures else None)
    return results  # unreachable


def _grace_seconds(timeout: float | None) -> float:
    return 15.0 if timeout is None else min(15.0, timeout + 5.0)


def _read_report(conn, proc) -> tuple:
    try:
        if conn.poll(0.5):
            return read_report(conn)
    except (EOFError, OSError):
        pass
    proc.join(5)
    return ("died", proc.exitcode)


def _stop(procs, exit_grace: float = 0.0) -> None:
    """Stop every rank: wait up to ``exit_grace`` seconds for a clean exit, then terminate, then kill."""
    deadline = time.monotonic() + exit_grace
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(5)
        if p.is_alive():
            p.kill()
            p.join()


def _raise_failure(failures, missing, timed_out) -> None:
    failures.sort(key=lambda f: f[0])
    lines = []
    for _, rank, report in failures:
        if report[0] == "died":
            code = report[1]
            how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
            lines.append(f"rank {rank} died without reporting ({how})")
        else:
            first_line = report[2].strip().splitlines()[-1]
            lines.append(f"rank {rank} raised {first_line}")
    if missing:
        lines.append(f"ranks {missing} were stopped" + (f" after the {timed_out}s join timeout" if timed_out else ""))
    summary = "; ".join(lines)
    failed = [rank for _, rank, _ in failures]
    first = failures[0] if failures else None
    if first is not None and first[2][0] == "error" and first[2][1] is not None:
        exc = first[2][1]
        exc.add_note(f"[launch] {summary}\n[launch] traceback of rank {first[1]}:\n{first[2][2]}")
        raise exc
    detail = f"\ntraceback of rank {first[1]}:\n{first[2][2]}" if first and first[2][0] == "error" else ""
    raise LaunchError(f"launch failed: {summary}{detail}", failed or missing)
