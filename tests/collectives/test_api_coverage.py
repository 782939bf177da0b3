"""docs/api-coverage.md is generated from dir(torch.distributed) and up to date; supported names are
used by test code."""

from __future__ import annotations

import ast
import importlib.util
import textwrap
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


def _references(tree: ast.AST, modules: set[str]) -> set[str]:
    """Names of ``modules`` that the code in ``tree`` uses: ``alias.NAME`` where ``alias`` is bound
    to one of the modules (``import collectives as dist``, ``dist = collectives``, or any
    expression built on such a name, like a dict of libraries) and names imported from them and
    then used. Comments, docstrings and prose do not count; code inside string constants (the
    scripts tests write and run) does."""
    aliases: set[str] = set()
    imported: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {a.asname or a.name for a in node.names if a.name in modules and (a.asname or "." not in a.name)}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in modules:
            imported.update({a.asname or a.name: a.name for a in node.names})
    assignments = [n for n in ast.walk(tree) if isinstance(n, ast.Assign)]
    while True:  # names bound to expressions that hold a module alias, to a fixed point
        more = {
            t.id
            for n in assignments
            if any(isinstance(v, ast.Name) and v.id in aliases for v in ast.walk(n.value))
            for t in n.targets
            if isinstance(t, ast.Name) and t.id not in aliases
        }
        if not more:
            break
        aliases |= more
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            found.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id in imported:
            found.add(imported[node.id])
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and "import" in node.value:
            try:
                found |= _references(ast.parse(textwrap.dedent(node.value)), modules)
            except SyntaxError:
                pass
    return found


def test_every_supported_name_is_exercised_by_a_test():
    """Each name collectives implements is used by test code: an attribute of the collectives
    module (under any alias) or a name imported from it, in code, not in a comment or docstring.
    The scripts under tests/collectives/scripts are torch.distributed programs that
    test_swap_import.py also runs with the import swapped for collectives, so their ``dist.NAME``
    counts too. (Names re-exported from torch are torch's own objects; test_compat checks that
    they are.)"""
    script = _script()
    used: set[str] = set()
    for path in (ROOT / "tests").rglob("*.py"):
        modules = {"collectives", "torch.distributed"} if "scripts" in path.parts else {"collectives"}
        used |= _references(ast.parse(path.read_text()), modules)
    untested = [name for name, _, status, _ in script.rows() if status == script.SUPPORTED and name not in used]
    assert not untested, f"supported names without a test: {untested}"


def test_a_name_in_a_comment_or_docstring_does_not_count():
    """Negative control of the check above."""
    source = '''
import collectives as c
# c.all_reduce(t)
def f():
    """collectives.broadcast and c.scatter are mentioned here."""
    return c.gather
'''
    assert _references(ast.parse(source), {"collectives"}) == {"gather"}
