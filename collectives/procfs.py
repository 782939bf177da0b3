"""What Linux's ``/proc/<pid>/stat`` says about a process: its state letter, parent and start time.

One parser for the launcher (is a rank stopped?), the elastic heartbeat (is the pid we would kill
still the process we mean, not a new one that reuses its number?) and the tests' leak checks
(which forkserver is the test session's own?).
The command name (field 2) is in parentheses and may itself hold spaces or parentheses, so the
fields are counted after its *last* closing parenthesis.
"""

from __future__ import annotations


def stat_fields(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (``[0]`` is the state letter,
    ``[19]`` the start time in clock ticks since boot), or None if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):  # exited, or no /proc
        return None


def state(pid: int) -> str | None:
    """The state letter (``R``, ``S``, ``T`` stopped, ``t`` traced, ``Z`` zombie...), or None."""
    fields = stat_fields(pid)
    return fields[0] if fields else None


def parent(pid: int) -> int | None:
    """The parent's pid, or None if there is no such process."""
    fields = stat_fields(pid)
    return int(fields[1]) if fields and len(fields) > 1 else None


def start_time(pid: int) -> str | None:
    """The start time in clock ticks since boot (with the pid, it names one process), or None."""
    fields = stat_fields(pid)
    return fields[19] if fields and len(fields) > 19 else None
