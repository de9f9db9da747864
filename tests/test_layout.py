"""The shape of the code base: no import cycle among the top-level modules (function-level
imports included), each stage module runs alone, and nothing points outside the repository."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
MODULES = {p.stem: p for p in REPO.glob("*.py")}


def import_graph() -> dict[str, set[str]]:
    """module → the top-level modules it imports anywhere in its code."""
    graph: dict[str, set[str]] = {}
    for name, path in MODULES.items():
        imported: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                imported |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                imported.add(node.module.split(".")[0])
        graph[name] = {m for m in imported if m in MODULES and m != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_cycle_among_top_level_modules():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_leaf_modules_stay_leaves():
    graph = import_graph()
    assert graph["utils"] == set()
    assert graph["metrics"] == set()
    assert graph["limits"] <= {"utils"}
    assert graph["runtime"] <= {"utils", "preprocess", "limits"}
    assert graph["tables"] <= {"utils", "limits"}
    assert graph["profiling"] <= {"utils", "runtime"}


@pytest.mark.parametrize("script", ["pipeline.py", "train.py", "export.py", "quantize.py",
                                    "inference.py"])
def test_each_stage_runs_alone(script):
    result = subprocess.run([sys.executable, script, "--help"], cwd=REPO, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "usage:" in result.stdout


def test_nothing_refers_outside_the_repository():
    texts = [*REPO.glob("*.py"), *REPO.glob("tests/*.py"), *REPO.glob("bench/*.py"),
             *REPO.glob("docs/*.md"), REPO / "README.md"]
    offenders = [str(p.relative_to(REPO)) for p in texts
                 if any(word in p.read_text(encoding="utf-8")
                        for word in ("../" "shared", "DESIGN" ".md", '/ "shared"'))
                 and p.name != "test_layout.py"]
    assert offenders == []


def test_readme_is_short_and_its_doc_links_resolve():
    import re

    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 250
    assert readme.count("```bash") >= 2 and ".venv/bin/python -m pytest -q" in readme
    links = re.findall(r"\]\((docs/[^)#]+)", readme)
    assert links and all((REPO / link).is_file() for link in links), links
