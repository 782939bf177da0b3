"""docs/api-coverage.md is generated from dir(torch.distributed) and up to date; supported names are tested."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _script():
    spec = importlib.util.spec_from_file_location("api_coverage", ROOT / "scripts" / "api_coverage.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_coverage_table_is_up_to_date():
    script = _script()
    assert (ROOT / "docs" / "api-coverage.md").read_text() == script.render(), (
        "docs/api-coverage.md is out of date: run python scripts/api_coverage.py"
    )


def test_every_supported_name_is_exercised_by_a_test():
    """Each name collectives implements appears as ``dist.NAME`` or ``collectives.NAME`` in tests.

    (Names re-exported from torch are torch's own objects; test_compat checks that they are.)
    """
    script = _script()
    text = "\n".join(p.read_text() for p in (ROOT / "tests").rglob("*.py"))
    untested = [
        name
        for name, _, status, _ in script.rows()
        if status == script.SUPPORTED and not re.search(rf"\b(dist|collectives)\.{re.escape(name)}\b", text)
    ]
    assert not untested, f"supported names without a test: {untested}"
