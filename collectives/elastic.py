"""Groups that survive a member's death: heartbeats, fencing, and re-formed generations (opt-in).

By default a dead or silent peer makes every other rank raise within the group's timeout, and the
group stays broken (:mod:`collectives.group`): fail fast. An :class:`ElasticGroup` goes further.
Its members watch each other's heartbeats, and after a failure the survivors re-form the group
without restarting their processes: a new **generation**, with the same slots filled (a
replacement process takes the dead member's slot) or with fewer (shrink).

**Slots and members.** A job has ``world_size`` slots (what the training loop calls ranks). The
process in a slot is a member, with a unique id (``uid``, from a counter in the store): a
replacement is a new member in the old slot. A generation is a list of members ordered by slot;
its group rank ``i`` is the ``i``-th of them.

**Heartbeats** (:class:`Heartbeat`). Every member's own thread, on a store connection of its own
(the main connection may be held by a blocking request of the gloo rendezvous), bumps a counter
in the store every ``bound / 4`` seconds and reads its peers'. A peer whose counter has not moved
for ``bound`` seconds (default 2 s) is declared silent: a stopped process (SIGSTOP, a debugger,
a stuck host) is found this way long before the collective timeout, and a dead one too. The
watcher then **fences** it: it writes ``fenced/<uid>`` into the store, kills the process if it
runs on this host (checked by pid *and* start time, so a recycled pid is never hit), and marks
the current group broken naming the peer. Killing it closes its sockets, so the survivors' waits
inside a collective end at once (EOF on the shared-memory wake-up sockets, a reset gloo
connection) instead of at the deadline.

**Re-forming** (:meth:`ElasticGroup.reform`). Each survivor closes the broken generation (its
threads stop, its shared-memory segments are released, its gloo connections are closed: a
broken group lets go of its process group, and a garbage collection frees the gloo transfers
that a failure's traceback still held in reference cycles, so a survivor still waiting on this
one inside the failed collective fails at once rather than at its deadline; a process that
calls :func:`gc.freeze` once set up makes that collection cheap) and asks to join the next one by
appending ``uid:slot`` to that generation's log in the store (an ``add`` gives each entry its
index). When the wanted slots are all present (or, when shrinking is allowed, when the wait is
over), a member proposes the membership with ``compare_set`` on the generation's ``members``
key: the first proposal wins, and every member adopts the one stored, so all agree without a
leader. Fenced members never enter a proposal. The members then say they are ready; should one
be fenced before all are (it died right after the decision), the others move on to the next
generation at once rather than wait for it in the group's rendezvous. A process that joins
(at the start, or as a replacement) takes the first generation not yet decided (``next``).
Heartbeats watch every member of the job that ever beat, forming generations included.

**Fencing a member that wakes up.** A stopped member that is resumed after it was fenced finds
``fenced/<uid>`` (its heartbeat thread looks every beat): its group is marked broken with
:class:`FencedError`, and :meth:`~ElasticGroup.reform` raises it. It can never be read as a
member of a newer generation (the proposals leave it out), nor write into a newer
generation's memory: each generation has its own store prefix, gloo connections and
shared-memory segments, and the survivors unmapped and unlinked the old ones.

**What it needs.** A TCP store whose server outlives the members (the launcher's, or torchrun's
agent store; not one hosted by a member). A member cut off from that store (its host's link
is down) cannot wait on it: the store client's requests then block past any deadline. Its own
heartbeat shows it (no beat went through for the bound, which is when the others fence it), so
:meth:`~ElasticGroup.reform` raises :class:`FencedError` without touching the store, and
:meth:`~ElasticGroup.close` skips saying goodbye. Cost when nothing fails: the heartbeat thread's two
store requests per beat (well under 1 ms each on one host), off the critical path.
"""

from __future__ import annotations

import dataclasses
import datetime
import gc
import logging
import os
import signal
import threading
import time
from typing import Callable, Sequence

import torch.distributed as dist

from . import procfs
from .errors import CollectiveError, CollectiveTimeoutError, timed_out, timeout_seconds
from .group import Group, host_key

log = logging.getLogger(__name__)

#: default heartbeat bound in seconds: a member silent this long is declared dead
DEFAULT_BOUND = 2.0


class FencedError(CollectiveError):
    """This member was declared dead by its peers (or left out of a generation): it may not take
    part in the group any more. Its process should exit; a replacement can take its slot."""


@dataclasses.dataclass(frozen=True, order=True)
class Member:
    """A process in a slot: ``slot`` (its rank in a full world), ``uid`` (unique in the job)."""

    slot: int
    uid: int


def _tcp_store(store: dist.Store) -> dist.TCPStore:
    """The TCP store under ``store``'s prefixes (heartbeats need a connection of their own)."""
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    if not isinstance(store, dist.TCPStore):
        raise TypeError(f"ElasticGroup: needs a TCPStore (behind any PrefixStore), got {type(store).__name__}")
    return store


class Heartbeat:
    """A member's heartbeat thread: publishes its own counter, watches every other member of the
    job (any generation, forming or formed), fences the silent ones (module docstring).

    Args:
        store: a connection of its own to the job's TCP store, under the group's prefix.
        me: this member (its ``proc/<uid>`` key is already published).
        bound: seconds of silence after which a peer is declared dead.
        kill: kill a silent peer's process if it runs on this host.
        on_silent: called (on the heartbeat thread) with the member found silent and the reason.
        on_fenced: called once when this member finds itself fenced.
    """

    def __init__(self, store: dist.Store, me: Member, bound: float, kill: bool, on_silent, on_fenced):
        self._store, self.me, self.bound, self._kill = store, me, bound, kill
        self._on_silent, self._on_fenced = on_silent, on_fenced
        self._seen: dict[int, tuple[Member, bytes, float]] = {}  # uid -> (member, counter, when it last moved)
        self._gone = {me.uid}  # not watched: this one, and members fenced or left
        self._beats = 0
        self._stop = threading.Event()
        self.beat()  # our key exists before anyone can watch it
        self._thread = threading.Thread(target=self._run, name=f"ringddp-heartbeat-{me.uid}", daemon=True)
        self._thread.start()

    def beat(self) -> None:
        self._beats += 1
        self._store.set(f"hb/{self.me.uid}", str(self._beats))
        self.last_beat = time.monotonic()

    def in_contact(self) -> bool:
        """Whether this member still reaches the store: a beat went through within the bound, or
        one does within the next bound (a beat is due every bound/4). A member cut off from the
        store (its host's link is down) is silent to the others, who fence it after the bound:
        it must not wait on the store, whose requests then block past any deadline."""
        deadline = time.monotonic() + self.bound
        while time.monotonic() - self.last_beat > self.bound:
            if time.monotonic() >= deadline or not self._thread.is_alive():
                return False
            time.sleep(0.01)
        return True

    def _run(self) -> None:
        interval = self.bound / 4
        while not self._stop.wait(interval):
            try:
                self.beat()
                if self._store.check([f"fenced/{self.me.uid}"]):
                    self._on_fenced(self._store.get(f"fenced/{self.me.uid}").decode())
                    return
                self._look()
            except Exception as exc:  # the store is gone: the job is ending
                if not self._stop.is_set():
                    log.warning("heartbeat of member %d stops: %s", self.me.uid, exc)
                return

    def _look(self) -> None:
        now = time.monotonic()
        for uid in range(int(self._store.add("uid", 0))):  # members that appeared: watched from now
            if uid not in self._gone and uid not in self._seen and self._store.check([f"hb/{uid}"]):
                slot = int(self._store.get(f"proc/{uid}").decode().split("|", 1)[0])
                self._seen[uid] = (Member(slot, uid), b"", now)
        watched = list(self._seen.items())
        if not watched:
            return
        counters = self._store.multi_get([f"hb/{uid}" for uid, _ in watched])
        now = time.monotonic()
        for (uid, (m, last, since)), counter in zip(watched, counters):
            if counter != last:
                self._seen[uid] = (m, counter, now)
                continue
            if now - since < self.bound:
                continue
            del self._seen[uid]
            self._gone.add(uid)
            if self._store.check([f"left/{uid}"]):
                continue  # it closed its group: not a failure
            reason = f"heartbeat: slot {m.slot} (member {uid}) silent for {now - since:.1f}s (bound {self.bound:g}s)"
            if not self._store.check([f"fenced/{uid}"]):  # else another member fenced it already
                self.fence(m, reason)
            self._on_silent(m, reason)

    def fence(self, m: Member, reason: str) -> None:
        """Declare ``m`` dead in the store and, if it runs on this host, kill it."""
        self._store.compare_set(f"fenced/{m.uid}", "", reason)
        if not self._kill:
            return
        _, host, pid, started = self._store.get(f"proc/{m.uid}").decode().split("|")
        if host == host_key() and procfs.start_time(int(pid)) == started:
            try:
                os.kill(int(pid), signal.SIGKILL)
                log.warning("killed silent member %d (pid %s): %s", m.uid, pid, reason)
            except ProcessLookupError:
                pass

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=self.bound + 5)


class ElasticGroup:
    """A group of ``world_size`` slots whose survivors re-form it after a failure (module docstring).

    Every process of the job constructs one with the same ``store`` and ``name``, its ``slot``,
    and the same ``world_size``; it joins the first generation not yet decided: at the start
    generation 0, which forms when every slot has a member; later (a replacement for a lost
    member, constructed the same way) the one the survivors form with :meth:`reform`.

    Args:
        store: the job's store: a TCPStore (or a PrefixStore over one) whose server outlives the
            members.
        slot: this process's slot, ``0 <= slot < world_size``.
        world_size: the number of slots.
        name: keeps several elastic groups of one store apart.
        backend: our backend of every generation's group (see :func:`collectives.init_process_group`).
        timeout: deadline of every wait inside a collective and of forming a generation (seconds).
        heartbeat: seconds of silence after which a member is declared dead (``None``: no
            heartbeats; only failed collectives then show a failure).
        kill_silent: kill a silent member's process when it runs on this host.

    Attributes:
        group: the current generation's :class:`~collectives.group.Group`: pass it as ``group=``.
        generation: its number (0 for the first).
        members: its members, by group rank.
    """

    def __init__(
        self,
        store: dist.Store,
        slot: int,
        world_size: int,
        *,
        name: str = "elastic",
        backend: str | None = None,
        timeout: datetime.timedelta | float = 60.0,
        heartbeat: float | None = DEFAULT_BOUND,
        kill_silent: bool = True,
    ):
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"ElasticGroup: world_size must be a positive int, got {world_size!r}")
        if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < world_size:
            raise ValueError(f"ElasticGroup: slot must be an int in 0..{world_size - 1}, got {slot!r}")
        if heartbeat is not None and not heartbeat > 0:
            raise ValueError(f"ElasticGroup: heartbeat must be a positive number of seconds or None, got {heartbeat!r}")
        base = _tcp_store(store)
        prefix = f"ringddp/elastic/{name}/"
        self._store = dist.PrefixStore(prefix, base)
        self.world_size, self.name, self.backend = world_size, name, backend
        self.timeout = timeout_seconds(timeout)
        self.me = Member(slot, int(self._store.add("uid", 1)) - 1)
        self._store.set(f"proc/{self.me.uid}", f"{slot}|{host_key()}|{os.getpid()}|{procfs.start_time(os.getpid())}")
        self._fenced: str | None = None
        self._heartbeat = None
        if heartbeat is not None:
            own = dist.TCPStore(base.host, base.port, is_master=False, wait_for_workers=False,
                                timeout=datetime.timedelta(seconds=self.timeout))
            self._heartbeat = Heartbeat(
                dist.PrefixStore(prefix, own), self.me, heartbeat, kill_silent, self._silent, self._was_fenced
            )
        self.group: Group | None = None
        self.generation = -1
        self.members: list[Member] = []
        self._join(0, allow_shrink=False, wait=self.timeout)

    # ------------------------------------------------------------------------ state

    def rank(self) -> int:
        """This member's rank in the current generation."""
        return self.members.index(self.me)

    def size(self) -> int:
        return len(self.members)

    def _silent(self, m: Member, reason: str) -> None:
        group = self.group
        if group is not None and m in self.members:
            group.mark_broken(CollectiveError(reason, op="heartbeat", peer=self.members.index(m)))

    def _was_fenced(self, reason: str) -> None:
        self._fenced = reason
        log.error("this member (%d, slot %d) was fenced: %s", self.me.uid, self.me.slot, reason)
        if self.group is not None:
            self.group.mark_broken(FencedError(f"fenced: {reason}", op="heartbeat"))

    # ------------------------------------------------------------------------ generations

    def reform(self, *, allow_shrink: bool = False, wait: float | None = None) -> Group:
        """Leave the current generation and form the next with the other survivors (and any
        replacement); returns its group.

        Waits up to ``wait`` seconds (default: the timeout) for every slot to have a member. If
        some are still empty then: with ``allow_shrink`` the generation forms with the slots
        present, once every member of the last generation that is neither fenced nor left (its
        :meth:`close`) is among them (``wait=0``: shrink by the members that closed, without
        waiting for replacements); otherwise :class:`~collectives.errors.CollectiveTimeoutError` names the empty
        slots. Raises :class:`FencedError` if this member was fenced or left out.
        """
        if self.group is not None:
            old, self.group = self.group, None
            old.mark_broken(CollectiveError(f"group {old.name} re-forms", op="reform"))
            old.close()
            del old
            gc.collect()  # what still holds its connections: a failure's traceback, in cycles (module docstring)
        if self._fenced is None and self._heartbeat is not None and not self._heartbeat.in_contact():
            self._fenced = (f"cut off: no heartbeat reached the store for {self._heartbeat.bound:g}s (the others fence "
                            "a member that silent)")
            raise FencedError(f"reform: this member (slot {self.me.slot}) is {self._fenced}", op="reform")
        return self._join(self.generation + 1, allow_shrink, self.timeout if wait is None else wait)

    def _check_fenced(self) -> None:
        if self._fenced is None and self._store.check([f"fenced/{self.me.uid}"]):
            self._fenced = self._store.get(f"fenced/{self.me.uid}").decode()
        if self._fenced is not None:
            raise FencedError(f"reform: this member (slot {self.me.slot}) was fenced: {self._fenced}", op="reform")

    def _join(self, gen: int, allow_shrink: bool, wait: float) -> Group:
        """Join generation ``gen`` or, if it was decided already, the first one not yet decided."""
        deadline = time.monotonic() + wait
        while True:
            self._check_fenced()
            gen = max(gen, int(self._store.add("next", 0)))
            decided = self._decide(gen, allow_shrink, deadline, wait)
            while (undecided := int(self._store.add("next", 0))) <= gen:  # for replacements and laggards
                self._store.compare_set("next", str(undecided), str(gen + 1))
            if self.me not in decided:
                self._fenced = f"left out of generation {gen} (members {[(m.slot, m.uid) for m in decided]})"
                raise FencedError(f"reform: this member (slot {self.me.slot}) was {self._fenced}", op="reform")
            if self._all_ready(f"g{gen}/", decided, time.monotonic() + self.timeout, self.timeout):
                break
            gen += 1  # a member died before the generation formed: the next one, without it
        self.members, self.generation = decided, gen
        rank = decided.index(self.me)
        self.group = Group.from_store(
            dist.PrefixStore(f"g{gen}/group/", self._store), rank, len(decided), self.timeout,
            backend=self.backend, name=f"{self.name}@{gen}",
        )
        log.info("generation %d of %s: members %s, this is rank %d", gen, self.name, [(m.slot, m.uid) for m in decided], rank)
        return self.group

    def _until(self, attempt: Callable[[], bool], deadline: float, late: Callable[[], CollectiveTimeoutError]) -> None:
        """Call ``attempt`` until it returns True, pausing 1 ms doubling to 50 ms between tries;
        raise ``late()`` past ``deadline``, or :class:`FencedError` once this member is fenced."""
        pause = 0.001
        while not attempt():
            if time.monotonic() >= deadline:
                raise late()
            self._check_fenced()
            time.sleep(pause)
            pause = min(2 * pause, 0.05)

    def _decide(self, gen: int, allow_shrink: bool, deadline: float, wait: float) -> list[Member]:
        """Ask to join ``gen`` and wait for its membership (proposing it once the slots are filled)."""
        log_key = f"g{gen}/"
        index = int(self._store.add(log_key + "count", 1))
        self._store.set(f"{log_key}entry/{index}", f"{self.me.uid}:{self.me.slot}")
        present: dict[int, Member] = {}

        def decided() -> bool:
            nonlocal present
            if self._store.check([log_key + "members"]):
                return True
            present = self._present(log_key)
            if len(present) == self.world_size or (allow_shrink and present and self._may_shrink(present, deadline)):
                proposal = ",".join(f"{m.uid}:{m.slot}" for m in sorted(present.values()))
                self._store.compare_set(log_key + "members", "", proposal)
                return True
            return False

        def late() -> CollectiveTimeoutError:
            empty = sorted(set(range(self.world_size)) - set(present))
            return CollectiveTimeoutError(
                f"reform: generation {gen} of {self.name}: slots {empty} have no member: {timed_out(wait)}", op="reform"
            )

        self._until(decided, deadline + (self.timeout + 1 if allow_shrink else 0), late)  # shrinking: _may_shrink
        stored = self._store.get(log_key + "members").decode()
        return [Member(int(s), int(u)) for u, s in (e.split(":") for e in stored.split(","))]

    def _may_shrink(self, present: dict[int, Member], deadline: float) -> bool:
        """Form with the slots present? Once the wait for replacements is over, and every member of
        the last generation that neither was fenced nor left is among them (a survivor slower to
        see the failure is waited for, not left out), or at the latest ``timeout`` after the wait."""
        now = time.monotonic()
        if now < deadline:
            return False
        away = [m for m in self.members if m.slot not in present]
        return now >= deadline + self.timeout or all(
            self._store.check([f"fenced/{m.uid}"]) or self._store.check([f"left/{m.uid}"]) for m in away)

    def _all_ready(self, log_key: str, decided: list[Member], deadline: float, wait: float) -> bool:
        """Say this member is ready for the generation and wait for the others: True when all are,
        False as soon as one of them is fenced (it died or stopped after the decision)."""
        self._store.set(f"{log_key}ready/{self.me.uid}", "1")
        keys = [f"{log_key}ready/{m.uid}" for m in decided]
        fenced = False

        def over() -> bool:
            nonlocal fenced
            if self._store.check(keys):
                return True
            fenced = any(self._store.check([f"fenced/{m.uid}"]) for m in decided)
            return fenced

        def late() -> CollectiveTimeoutError:
            missing = [m.slot for m in decided if not self._store.check([f"{log_key}ready/{m.uid}"])]
            return CollectiveTimeoutError(
                f"reform: generation {log_key[1:-1]} of {self.name}: slots {missing} never got ready: {timed_out(wait)}",
                op="reform",
            )

        self._until(over, deadline, late)
        return not fenced

    def _present(self, log_key: str) -> dict[int, Member]:
        """The members that asked to join, one per slot (the newest member of a slot), none fenced."""
        count = int(self._store.add(log_key + "count", 0))
        entries = self._store.multi_get([f"{log_key}entry/{i}" for i in range(1, count + 1)]) if count else []
        by_slot: dict[int, Member] = {}
        for entry in entries:
            uid, slot = (int(x) for x in entry.decode().split(":"))
            if self._store.check([f"fenced/{uid}"]):
                continue
            if slot not in by_slot or uid > by_slot[slot].uid:
                by_slot[slot] = Member(slot, uid)
        return by_slot

    def close(self) -> None:
        """Leave: say so (the peers' heartbeats stop watching this member), stop the heartbeat,
        close the group."""
        if self._heartbeat is None or self._heartbeat.in_contact():
            self._store.set(f"left/{self.me.uid}", "1")
        if self._heartbeat is not None:
            self._heartbeat.stop()
        if self.group is not None:
            self.group.close()
            self.group = None
