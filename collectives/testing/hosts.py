"""Emulated hosts on one machine: network namespaces joined by a bridge, with an optional shaped link.

A *host* here is a Linux network namespace with its own ``eth0`` (a veth pair whose other end sits
on a bridge in a namespace of its own), an address from 198.18.0.0/15 (the benchmarking range,
RFC 2544) and its loopback up. Ranks started in a host see only that host's interfaces, so ranks
of different hosts talk over the bridge exactly as two machines would talk over a switch; ranks of
one host talk over its loopback. ``tc`` shapes each host's ``eth0`` (its outgoing traffic):

    with HostNet(hosts=2, link="netem delay 1ms rate 1gbit") as net:
        results = net.launch(fn, ranks_per_host=2)   # like collectives.launch, 4 ranks on 2 hosts

Ranks join through ``env://`` exactly as under torchrun: ``MASTER_ADDR`` is host 0's address,
``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK`` (the host's index)
are set, and ``GLOO_SOCKET_IFNAME=eth0`` binds gloo to the host's network interface.

Nothing is created outside the namespaces this module makes, and everything is removed on exit,
on an exception, on KeyboardInterrupt and at interpreter exit (``atexit``); names carry the
creating process's pid (``rdh<pid>x<k>-h0``), and every new :class:`HostNet` first sweeps away the
namespaces of earlier runs whose process is gone (crashed or SIGKILLed).

Needs root, ``ip`` and ``tc`` (iproute2); :func:`unavailable` says why not, for skipping tests.
``link`` is any ``tc qdisc`` spec: ``"tbf rate 1gbit burst 256kb latency 50ms"`` shapes bandwidth
only; ``"netem delay 1ms rate 1gbit"`` adds latency. Where the kernel has no netem qdisc (built
without ``CONFIG_NET_SCH_NETEM``), a netem link is emulated in userspace instead, with a warning:
each host's ``eth0`` is then a TUN device and :mod:`collectives.testing.linkemu` (one Python process,
on the same cores as the ranks) forwards the packets between hosts with netem's ``delay``, ``rate``
and ``limit`` (nothing else; other keywords raise ValueError). ``emulator="user"`` forces it,
``"tc"`` forbids it; :func:`link_unavailable` says whether a spec can be had either way. The
emulator needs ``/dev/net/tun``; it dies with the process that made the :class:`HostNet`.

Note: every namespace of one machine still shares ``/dev/shm`` and the file system. Host identity
for topology therefore includes the network namespace (:func:`collectives.group.host_key`):
two ranks in different namespaces are on different hosts and must talk over the network.
"""

from __future__ import annotations

import atexit
import functools
import itertools
import logging
import os
import pickle
import re
import select
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Sequence

from ..launch import Report, grace_seconds, launch, raise_failure, set_parent_death_signal
from . import linkemu

log = logging.getLogger(__name__)

PREFIX = "rdh"
SUBNET = "198.18.0"  # host i is SUBNET.(i + 1)/24
PORT = 29500  # free by construction: host 0's namespace is ours
EMULATORS = ("auto", "tc", "user")
TUN_MTU = 65000  # the userspace emulator's eth0: few, large packets keep the Python forwarder cheap
FORWARDER = linkemu.__file__  # run as a script: the forwarder imports no torch
FORWARDER_START_S = 10.0
_counter = itertools.count()
_live: set["HostNet"] = set()


class HostNetError(RuntimeError):
    """A namespace, link or qdisc could not be set up."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and done.returncode != 0:
        raise HostNetError(f"ip {' '.join(args)} failed: {done.stderr.strip()}")
    return done


def unavailable() -> str | None:
    """Why namespace hosts cannot be made here (for ``pytest.skip``), or None if they can."""
    if sys.platform != "linux":
        return "namespace hosts need Linux"
    if os.geteuid() != 0:
        return "namespace hosts need root (ip netns add)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"namespace hosts need `{tool}` (iproute2)"
    name = f"{PREFIX}{os.getpid()}probe"
    done = _ip("netns", "add", name, check=False)
    if done.returncode != 0:
        return f"ip netns add failed: {done.stderr.strip()}"
    _ip("netns", "del", name, check=False)
    return None


def link_unavailable(spec: str, emulator: str = "auto") -> str | None:
    """Why the link ``spec`` (e.g. ``"netem delay 1ms"``) cannot be had here with ``emulator``, or None."""
    try:
        with HostNet(hosts=1, link=spec, emulator=emulator):
            pass
    except (HostNetError, ValueError) as exc:
        return str(exc)
    return None


@functools.lru_cache(maxsize=None)
def netem_missing() -> bool:
    """Whether this kernel lacks the netem qdisc (probed once in a scratch namespace; logs a warning)."""
    name = f"{PREFIX}{os.getpid()}probe"
    _ip("netns", "add", name)
    try:
        done = subprocess.run(["ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", "lo", "root", "netem"],
                              capture_output=True, text=True)
    finally:
        _ip("netns", "del", name, check=False)
    missing = done.returncode != 0 and "unknown" in done.stderr
    if missing:
        log.warning("this kernel has no netem qdisc (tc: %s): HostNet emulates netem links in userspace "
                    "(collectives.testing.linkemu, on the same cores as the ranks)", done.stderr.strip())
    return missing


def sweep() -> list[str]:
    """Delete namespaces left by earlier runs of this module whose process no longer exists."""
    removed = []
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        m = re.match(rf"{PREFIX}(\d+)", name)
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            _ip("netns", "del", name, check=False)
            removed.append(name)
    if removed:
        log.warning("removed stale namespaces of crashed runs: %s", removed)
    return removed


def _close_all() -> None:
    for net in list(_live):
        net.close()


atexit.register(_close_all)


class HostNet:
    """``hosts`` network namespaces on one bridge; a context manager that removes them on exit.

    Args:
        hosts: number of emulated hosts (1..250).
        link: ``tc qdisc`` spec applied to every host's ``eth0`` (its outgoing traffic), e.g.
            ``"netem delay 1ms rate 1gbit"``; None leaves the link unshaped.
        emulator: who applies a ``netem`` link: ``"tc"`` (the kernel's qdisc on a veth),
            ``"user"`` (:mod:`~collectives.testing.linkemu` between TUN devices; delay, rate and
            limit only) or ``"auto"`` (tc where the kernel has netem, else user).
    """

    def __init__(self, hosts: int = 2, link: str | None = None, emulator: str = "auto"):
        if not 1 <= hosts <= 250:
            raise ValueError(f"HostNet: hosts must be 1..250, got {hosts}")
        if emulator not in EMULATORS:
            raise ValueError(f"HostNet: emulator must be one of {EMULATORS}, got {emulator!r}")
        netem = bool(link) and link.split()[:1] == ["netem"]
        if emulator == "user" and not netem:
            raise ValueError(f"HostNet: emulator='user' emulates netem links ({linkemu.SUPPORTED}), got {link!r}")
        self.hosts = hosts
        self.link = link
        self.emulator = emulator
        # the userspace emulator's settings; None: links are veths on a bridge, shaped (or not) by tc
        self.emulated: linkemu.LinkSpec | None = linkemu.LinkSpec.parse(link) if emulator == "user" else None
        self._netem = netem
        self.tag = f"{PREFIX}{os.getpid()}x{next(_counter)}"
        self.bridge_ns = f"{self.tag}-br"
        self.namespaces = [f"{self.tag}-h{i}" for i in range(hosts)]
        self._procs: list[subprocess.Popen] = []
        self._made: list[str] = []
        self._forwarder: subprocess.Popen | None = None
        self._forwarder_log: Any = None

    def address(self, host: int) -> str:
        return f"{SUBNET}.{host + 1}"

    def __enter__(self) -> "HostNet":
        sweep()
        if self.emulator == "auto" and self._netem and netem_missing():
            self.emulated = linkemu.LinkSpec.parse(self.link)  # ValueError names what it supports
        _live.add(self)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _build(self) -> None:
        for ns in (self.bridge_ns, *self.namespaces):
            self._made.append(ns)
            _ip("netns", "add", ns)
        if self.emulated is None:
            _ip("-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.bridge_ns, "link", "set", "br0", "up")
        else:
            self._start_forwarder()
        for i, ns in enumerate(self.namespaces):
            if self.emulated is None:
                port = f"p{i}"
                _ip("link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", port, "netns", self.bridge_ns)
                _ip("-n", self.bridge_ns, "link", "set", port, "master", "br0", "up")
            else:  # the forwarder's TUN device t<i> becomes the host's eth0; the forwarder keeps its fd
                _ip("-n", self.bridge_ns, "link", "set", f"t{i}", "netns", ns)
                _ip("-n", ns, "link", "set", f"t{i}", "name", "eth0", "mtu", str(TUN_MTU))
            _ip("-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            if self.link and self.emulated is None:
                self.shape(i, self.link)

    def _start_forwarder(self) -> None:
        """Start :mod:`~collectives.testing.linkemu` in the bridge's namespace; wait until its TUN devices exist."""
        argv = [sys.executable, "-I", FORWARDER, "--names", ",".join(f"t{i}" for i in range(self.hosts)),
                "--addresses", ",".join(map(self.address, range(self.hosts))), *self.emulated.argv()]
        output = tempfile.TemporaryFile()
        proc = self._popen(self.bridge_ns, argv, stdout=subprocess.PIPE, stderr=output)
        line = proc.stdout.readline() if select.select([proc.stdout], [], [], FORWARDER_START_S)[0] else None
        proc.stdout.close()
        if line != b"ready\n":
            if line is None:
                proc.kill()
            try:
                code = proc.wait(timeout=5)  # it is exiting: EOF before "ready"
            except subprocess.TimeoutExpired:
                proc.kill()
                code = proc.wait()
            why = f"did not start within {FORWARDER_START_S:.0f} s" if line is None else f"exited with code {code}"
            with output:
                raise HostNetError(f"the userspace link emulator {why}: {_tail(output)}")
        self._forwarder, self._forwarder_log = proc, output

    def shape(self, host: int, spec: str) -> None:
        """Replace the qdisc on ``host``'s ``eth0`` with the ``tc qdisc`` spec ``spec``."""
        argv = ["ip", "netns", "exec", self.namespaces[host], "tc", "qdisc", "replace", "dev", "eth0", "root"]
        argv += spec.split()
        done = subprocess.run(argv, capture_output=True, text=True)
        if done.returncode != 0:
            hint = " (this kernel lacks CONFIG_NET_SCH_NETEM; emulator='auto' or 'user' emulates netem in userspace)" if (
                "netem" in spec and "unknown" in done.stderr) else ""
            raise HostNetError(f"tc qdisc {spec!r} on host {host}: {done.stderr.strip()}{hint}")

    def set_link(self, host: int, up: bool) -> None:
        """Take ``host``'s network link down (or up again): its eth0 and its port on the bridge (if bridged)."""
        state = "up" if up else "down"
        _ip("-n", self.namespaces[host], "link", "set", "eth0", state)
        if self.emulated is None:
            _ip("-n", self.bridge_ns, "link", "set", f"p{host}", state)

    def popen(self, host: int, argv: Sequence[str], env: dict[str, str] | None = None, **kw: Any) -> subprocess.Popen:
        """Start ``argv`` inside ``host``'s namespace; stopped by :meth:`close` if still running."""
        return self._popen(self.namespaces[host], argv, env=env, **kw)

    def _popen(self, ns: str, argv: Sequence[str], **kw: Any) -> subprocess.Popen:
        proc = subprocess.Popen(["ip", "netns", "exec", ns, *argv], **kw)
        self._procs.append(proc)
        return proc

    def rank_env(self, rank: int, ranks_per_host: int, extra: dict[str, str] | None = None) -> dict[str, str]:
        """torchrun's environment for ``rank`` of a job with ``ranks_per_host`` ranks on each host."""
        env = dict(os.environ)
        for key in ("SLURM_PROCID", "SLURM_NTASKS"):
            env.pop(key, None)
        env.update(
            MASTER_ADDR=self.address(0), MASTER_PORT=str(PORT), RANK=str(rank),
            WORLD_SIZE=str(self.hosts * ranks_per_host), LOCAL_RANK=str(rank % ranks_per_host),
            LOCAL_WORLD_SIZE=str(ranks_per_host), GROUP_RANK=str(rank // ranks_per_host),
            GLOO_SOCKET_IFNAME="eth0", PYTHONPATH=os.pathsep.join(p for p in sys.path if p),
        )
        env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # c10d warns that 198.18.x has no hostname
        env.update(extra or {})
        return env

    def launch(
        self,
        fn: Callable[..., Any],
        ranks_per_host: int,
        *args: Any,
        backend: str | None = None,
        timeout: float | None = None,
        join_timeout: float = 120.0,
        env: dict[str, str] | None = None,
    ) -> list[Any]:
        """Run ``fn(rank, world_size, *args)`` on ``ranks_per_host`` ranks in every host.

        Like :func:`collectives.launch`: ranks ``h * ranks_per_host ... (h + 1) * ranks_per_host - 1``
        run on host ``h``; the results come back as a list (index = rank), and the first rank to
        raise has its exception re-raised here with its traceback as a note (the others get a
        grace period, then are killed). ``fn`` must be importable by module and name.
        """
        size = self.hosts * ranks_per_host
        with tempfile.TemporaryDirectory(prefix="ringddp-hosts-") as tmp:
            main = _main_source() if fn.__module__ == "__main__" else None
            with open(os.path.join(tmp, "job.pkl"), "wb") as f:
                pickle.dump(main, f)
                pickle.dump((fn, args, backend, timeout), f)
            argv = [sys.executable, "-m", __name__, tmp]
            procs = [
                self.popen(rank // ranks_per_host, argv, env=self.rank_env(rank, ranks_per_host, env))
                for rank in range(size)
            ]
            reports: dict[int, Report] = {}
            failures: list[tuple[int, Report]] = []
            deadline = time.monotonic() + join_timeout
            while len(reports) < size and time.monotonic() < deadline:
                for rank, proc in enumerate(procs):
                    if rank in reports or proc.poll() is None:
                        continue
                    reports[rank] = _read(tmp, rank, proc.returncode)
                    if reports[rank].status != "ok":
                        failures.append((rank, reports[rank]))
                        deadline = min(deadline, time.monotonic() + grace_seconds(timeout))
                time.sleep(0.02)
            self._stop(procs)
        missing = [r for r in range(size) if r not in reports]
        if failures or missing:
            raise_failure(failures, missing, join_timeout if not failures else None)
        return [reports[r].value for r in range(size)]

    def _stop(self, procs: Sequence[subprocess.Popen]) -> None:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            p.wait()

    def close(self) -> None:
        """Stop every process started here and delete every namespace (idempotent)."""
        if self._forwarder is not None:
            if self._forwarder.poll() is not None:  # it should run until killed here: say why it did not
                log.warning("the userspace link emulator exited early (code %s): %s",
                            self._forwarder.returncode, _tail(self._forwarder_log))
            self._forwarder_log.close()
            self._forwarder = None
        self._stop(self._procs)
        self._procs.clear()
        for ns in reversed(self._made):
            _ip("netns", "del", ns, check=False)
        self._made.clear()
        _live.discard(self)


def _tail(f: Any) -> str:
    """The end of what a child wrote to the temporary file ``f``."""
    f.seek(0)
    return f.read().decode(errors="replace").strip()[-2000:] or "no output"


def _read(tmp: str, rank: int, code: int) -> Report:
    try:
        with open(os.path.join(tmp, f"rank{rank}.pkl"), "rb") as f:
            return pickle.load(f)
    except (OSError, EOFError, pickle.UnpicklingError):
        return Report("died", exitcode=code)


def _main_source() -> tuple[str, str] | None:
    """How a child finds the parent's ``__main__``: ("module", name) under ``-m``, else ("path", file)."""
    main = sys.modules["__main__"]
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name:
        return ("module", spec.name)
    path = getattr(main, "__file__", None)
    return ("path", path) if path else None


def _load_main(source: tuple[str, str]) -> None:
    """Load the parent's ``__main__`` as ``__mp_main__`` (as multiprocessing's spawn does)."""
    import importlib
    import importlib.util

    kind, where = source
    if kind == "module":
        module = importlib.import_module(where)
    else:
        spec = importlib.util.spec_from_file_location("__mp_main__", where)
        module = importlib.util.module_from_spec(spec)
        sys.modules["__mp_main__"] = module
        spec.loader.exec_module(module)
    sys.modules["__main__"] = sys.modules["__mp_main__"] = module


def _rank_main(tmp: str) -> None:
    """One rank inside a namespace host: join through env://, run the job, write the report."""
    set_parent_death_signal()
    rank = int(os.environ["RANK"])
    try:
        with open(os.path.join(tmp, "job.pkl"), "rb") as f:
            main = pickle.load(f)
            if main is not None:  # fn lives in the parent's script: load it as multiprocessing does
                _load_main(main)
            fn, args, backend, timeout = pickle.load(f)
        report = Report("ok", launch(fn, int(os.environ["WORLD_SIZE"]), *args, backend=backend, timeout=timeout)[rank])
        code = 0
    except BaseException as exc:
        report, code = Report.failure(exc), 1
    with open(os.path.join(tmp, f"rank{rank}.pkl.part"), "wb") as f:
        pickle.dump(report, f)
    os.replace(os.path.join(tmp, f"rank{rank}.pkl.part"), os.path.join(tmp, f"rank{rank}.pkl"))
    sys.stdout.flush()
    os._exit(code)  # skip interpreter teardown: a broken gloo group can hang in its destructor


if __name__ == "__main__":
    _rank_main(sys.argv[1])
