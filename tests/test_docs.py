"""The generated documents match their sources, and every relative link in the docs resolves.

docs/benchmarks.md and the summary table in README.md are rendered from docs/bench/*.json by
scripts/benchmarks.py (the way tests/collectives/test_api_coverage.py checks
docs/api-coverage.md); nothing here runs a benchmark.
"""

from __future__ import annotations

import re
from pathlib import Path

from tests import script_modules

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _script():
    return script_modules.load("benchmarks")


def test_every_suite_is_stored_with_its_command():
    script = _script()
    data = script.load()
    assert sorted(data) == sorted(s.name for s in script.SUITES), (
        "suites without a measurement: run python scripts/benchmarks.py measure SUITE"
    )
    for suite in script.SUITES:
        record = data[suite.name]
        assert record["command"] == suite.command, f"{suite.name}: measured with another command; measure it again"
        assert {"commit", "date", "machine", "seconds", "result"} <= record.keys()


def test_benchmarks_page_and_readme_summary_are_up_to_date():
    for path, text in _script().outputs().items():
        assert path.read_text() == text, f"{path.name} is out of date: run python scripts/benchmarks.py render"


def _anchors(markdown: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens, -1, -2 for repeats."""
    seen: dict[str, int] = {}
    anchors = set()
    text = re.sub(r"^```.*?^```", "", markdown, flags=re.MULTILINE | re.DOTALL)  # no headings in code blocks
    for heading in re.findall(r"^#{1,6} +(.+?) *$", text, flags=re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def test_relative_links_resolve():
    broken = []
    for doc in DOCS:
        text = re.sub(r"^```.*?^```", "", doc.read_text(), flags=re.MULTILINE | re.DOTALL)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue  # https://, mailto:
            path, _, anchor = target.partition("#")
            resolved = (doc.parent / path) if path else doc
            if not resolved.exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved.read_text()):
                broken.append(f"{doc.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)
