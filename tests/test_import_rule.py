"""Which splitgrad package may import which, read from every import statement of every package's
source (those inside functions too), and no cycle among them.

The library is reference (the spec, torch only), impl (the fast path, built on the reference's
contract), properties (the harness) and distributed. The measurements (bench) and the
``splitgrad`` command (cli) sit above them all; nothing imports the command.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

MAY_IMPORT = {
    "reference": set(),
    "impl": {"reference"},
    # the harness's distributed checks (P14-P16) run splitgrad.distributed on their ranks
    "properties": {"reference", "impl", "distributed"},
    "distributed": {"reference", "impl"},
    "bench": {"reference", "impl", "properties", "distributed"},
    "cli": {"reference", "impl", "properties", "distributed", "bench"},
}


def _imported(path: Path, package: str) -> set[str]:
    """The splitgrad packages (other than ``package``) and the outside top-level modules that
    ``path`` imports anywhere in it."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module or ""]
            if node.module == "splitgrad":  # from splitgrad import impl
                names = [f"splitgrad.{alias.name}" for alias in node.names]
        else:
            continue  # relative: within the package
        for name in names:
            parts = name.split(".")
            found.add(parts[1] if parts[0] == "splitgrad" and len(parts) > 1 else parts[0])
    found.discard(package)
    return found


def _graph() -> dict[str, dict[str, list[str]]]:
    """package -> imported splitgrad package or outside module -> files importing it."""
    graph: dict[str, dict[str, list[str]]] = {}
    for package in MAY_IMPORT:
        edges = graph.setdefault(package, {})
        for path in sorted((ROOT / package).rglob("*.py")):
            for name in _imported(path, package):
                edges.setdefault(name, []).append(str(path.relative_to(ROOT)))
    return graph


GRAPH = _graph()


@pytest.mark.parametrize("package", list(MAY_IMPORT))
def test_package_imports_only_what_the_rule_allows(package: str) -> None:
    wrong = {
        name: files
        for name, files in GRAPH[package].items()
        if name in MAY_IMPORT and name not in MAY_IMPORT[package]
    }
    assert not wrong, f"{package} may import only {sorted(MAY_IMPORT[package])}: {wrong}"


def test_the_reference_imports_torch_only() -> None:
    outside = {
        name: files
        for name, files in GRAPH["reference"].items()
        if name not in MAY_IMPORT and name not in sys.stdlib_module_names and name != "torch"
    }
    assert not outside, outside


def test_no_package_imports_the_command() -> None:
    assert not [p for p, edges in GRAPH.items() if "cli" in edges]


def test_no_cycle_between_packages() -> None:
    edges = {p: {n for n in GRAPH[p] if n in MAY_IMPORT} for p in MAY_IMPORT}
    done: set[str] = set()

    def visit(package: str, path: tuple[str, ...]) -> None:
        assert package not in path, f"import cycle: {' -> '.join((*path, package))}"
        if package not in done:
            for name in sorted(edges[package]):
                visit(name, (*path, package))
            done.add(package)

    for package in MAY_IMPORT:
        visit(package, ())


def test_every_package_folder_is_in_the_rule() -> None:
    """A new package mapped in pyproject.toml gets a line in MAY_IMPORT."""
    text = (ROOT / "pyproject.toml").read_text()
    mapped = {line.split('"')[3] for line in text.splitlines() if line.startswith('"splitgrad.')}
    assert mapped == set(MAY_IMPORT)
