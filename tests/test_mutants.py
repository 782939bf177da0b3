"""The short form of the mutant check (``python scripts/mutants.py`` runs the whole, ~5 minutes).

Every mutant's anchor still occurs exactly once and its edit carries the marker; and the marker
works: the canary's edit, which runs only in spawned rank processes, is seen as reached, while an
edit that sits where the tests never go (the line a fast path above it made dead, which is how
``subgroup-runs-on-the-world`` once survived) is reported NOT REACHED, not as a survivor.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from tests import script_modules

import pytest

ROOT = Path(__file__).resolve().parent.parent
ONE_RANK = "tests/collectives/test_p2p.py::test_world_of_one"  # one spawned rank, a few seconds


def _script():
    return script_modules.load("mutants")


def test_every_anchor_occurs_once_and_every_edit_marks_itself():
    script = _script()
    assert script.check_anchors(ROOT, list(script.MUTANTS)) == []
    for m in script.MUTANTS:
        text = script.mutated((ROOT / m.path).read_text(), m)
        assert text.count(f"__import__({script.MARK_MODULE!r}).reached()") == 1, m.name


@pytest.mark.timeout(180)
def test_an_edit_that_never_runs_is_not_reached_rather_than_survived(capsys):
    script = _script()
    canary = dataclasses.replace(next(m for m in script.MUTANTS if m.name == "canary"), tests=(ONE_RANK,))
    dead = script.Mutant(
        "dead-line",
        "(not a promise) member()'s last line, which no Group reaches: the fast path above returns it",
        "collectives/group.py",
        "        return None\n    return get_group(group)\n",
        "        return None\n    MUTANT_REACHED()\n    return get_group(None)\n",
        (ONE_RANK,),  # calls on the default group: member() returns before that line
    )
    assert script.run_mutants([canary, dead], baseline=False) == 2
    out = capsys.readouterr().out
    rows = {line.split()[0]: line for line in out.splitlines() if line.startswith(("canary ", "dead-line "))}
    assert re.search(r"killed .* 1 process ", rows["canary"]), out  # written by the rank, not by pytest
    assert "NOT REACHED" in rows["dead-line"] and "0 processes" in rows["dead-line"], out
    assert "1 of 2 mutants killed" in out and "NOT REACHED (the edit never ran" in out, out
