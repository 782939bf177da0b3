"""A persistent pool of ranks for testing collectives many times over.

Starting a multi-process job costs seconds (interpreter start, ``import torch``, rendezvous); a
property test runs hundreds of examples. :class:`WorkerPool` starts ``world_size`` ranks once and
then runs one small job after another on them::

    pool = WorkerPool(4)
    results = pool.run(my_check, case)      # my_check(rank, world_size, case) on every rank
    pool.close()

``fn`` must be picklable (a module-level function). A job that raises on any rank re-raises here
with that rank's traceback attached. A job that breaks communication (a rank dies or a wait times
out) makes the pool restart itself before the next job, so one bad example does not poison the
rest of a test session.
"""

from __future__ import annotations

import datetime
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import time
from typing import Any, Callable, Mapping

from ..errors import CollectiveError
from ..group import destroy_process_group
from ..launch import (LaunchError, Report, join_local, raise_failure, read_report, send_report, start_process, start_store,
                      stop_ranks)

log = logging.getLogger(__name__)


def _worker(rank: int, size: int, port: int, backend: str | None, timeout: float, level: int, env, conn) -> None:
    os.environ.update(env)
    try:
        join_local(rank, size, port, backend, timeout, level)
        send_report(conn, Report("ready"))
    except BaseException as exc:
        send_report(conn, Report.failure(exc))
        return
    try:
        while True:
            try:
                job = conn.recv()
            except EOFError:
                return
            if job is None:
                return
            fn, args = job
            try:
                send_report(conn, Report("ok", fn(rank, size, *args)))
            except BaseException as exc:
                send_report(conn, Report.failure(exc))
    finally:
        destroy_process_group()


class WorkerPool:
    """``world_size`` persistent ranks with collectives initialised, reused across jobs.

    Args:
        world_size: number of ranks.
        backend: collectives backend of the ranks' default group.
        timeout: the collectives' wait deadline inside the ranks (seconds); keep it short in tests
            so that a hang becomes an error quickly.
        job_timeout: how long :meth:`run` waits for all ranks before declaring the pool stuck.
        env: environment variables set in every rank before it joins, at every (re)start
            (e.g. ``{"RINGDDP_SHM_REGION_BYTES": "2048"}``).
    """

    def __init__(
        self,
        world_size: int,
        backend: str | None = None,
        timeout: float = 20.0,
        job_timeout: float = 60.0,
        log_level: int = logging.WARNING,
        env: Mapping[str, str] | None = None,
    ):
        if world_size < 1:
            raise ValueError(f"WorkerPool: world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.backend = backend
        self.timeout = timeout
        self.job_timeout = job_timeout
        self.log_level = log_level
        self.env = {str(k): str(v) for k, v in (env or {}).items()}
        self._procs: list[mp.process.BaseProcess] = []
        self._conns: list[Any] = []
        self._store = None

    def _start(self) -> None:
        self._store = start_store(self.world_size, datetime.timedelta(seconds=self.timeout))
        for rank in range(self.world_size):
            parent_end, child_end = mp.Pipe()
            p = start_process(_worker, (rank, self.world_size, self._store.port, self.backend, self.timeout,
                                        self.log_level, self.env, child_end), f"ringddp-pool-rank{rank}")
            child_end.close()
            self._procs.append(p)
            self._conns.append(parent_end)
        reports = self._collect(self.timeout + 60)
        if any(r.status != "ready" for r in reports.values()) or len(reports) < self.world_size:
            self.close()
            raise LaunchError(f"WorkerPool: ranks failed to start: {reports}")

    def run(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        """Run ``fn(rank, world_size, *args)`` on every rank; return the results by rank."""
        if not self._procs:
            self._start()
        for conn in self._conns:
            conn.send((fn, args))
        reports = self._collect(self.job_timeout)
        failures = [(r, rep) for r, rep in sorted(reports.items()) if rep.status != "ok"]
        missing = [r for r in range(self.world_size) if r not in reports]
        if not failures and not missing:
            return [reports[r].value for r in range(self.world_size)]
        if missing or any(rep.status == "died" or _breaks_group(rep) for _, rep in failures):
            log.warning("WorkerPool: restarting after a failed job (ranks %s)", [r for r, _ in failures] + missing)
            self.close()
        raise_failure(failures, missing, self.job_timeout if missing else None)

    def _collect(self, timeout: float) -> dict[int, Report]:
        deadline = time.monotonic() + timeout
        reports: dict[int, Report] = {}
        while len(reports) < self.world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            pending = {self._conns[r]: r for r in range(self.world_size) if r not in reports}
            pending.update({self._procs[r].sentinel: r for r in range(self.world_size) if r not in reports})
            for ready in mp.connection.wait(list(pending), left):
                rank = pending[ready]
                if rank in reports:
                    continue
                reports[rank] = read_report(self._conns[rank], self._procs[rank])
        return reports

    def close(self) -> None:
        """Stop the ranks (the next :meth:`run` starts fresh ones)."""
        for conn in self._conns:
            try:
                conn.send(None)
            except (OSError, BrokenPipeError):
                pass
        stop_ranks(self._procs, exit_grace=5.0)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns, self._store = [], [], None

    def __enter__(self) -> "WorkerPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _breaks_group(report: Report) -> bool:
    return report.status == "error" and (report.error is None or isinstance(report.error, CollectiveError))
