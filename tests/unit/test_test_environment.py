"""The test suite itself: no test module changes the process environment when it is imported.

A module-level ``os.environ.setdefault("DS_ACCELERATOR", "cpu")`` in a unit-test file stays set for
the whole pytest session, so on a GPU machine every run a later GPU test launches inherited it and
trained on the CPU. Tests change the environment through ``monkeypatch`` (undone after each test).
"""
import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
MUTATING = {"setdefault", "update", "pop", "clear", "popitem", "__setitem__", "__delitem__"}


def _is_environ(node) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "environ" and isinstance(node.value, ast.Name)
            and node.value.id == "os")


def _module_level_mutations(tree: ast.Module) -> list[int]:
    found = []
    for stmt in tree.body:  # statements run at import (functions and classes only define)
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        for node in ast.walk(stmt):
            call = isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            if call and node.func.attr in MUTATING and _is_environ(node.func.value):
                found.append(node.lineno)
            if call and isinstance(node.func.value, ast.Name) and node.func.value.id == "os" \
                    and node.func.attr in ("putenv", "unsetenv"):
                found.append(node.lineno)
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else \
                [node.target] if isinstance(node, ast.AugAssign) else []
            if any(isinstance(t, ast.Subscript) and _is_environ(t.value) for t in targets):
                found.append(node.lineno)
    return found


def test_no_test_module_changes_the_environment_at_import():
    offenders = [f"{path.relative_to(TESTS)}:{line}" for path in sorted(TESTS.rglob("*.py"))
                 for line in _module_level_mutations(ast.parse(path.read_text(), str(path)))]
    assert offenders == []


def test_the_check_sees_each_form():
    src = ('import os\nos.environ.setdefault("A", "1")\nos.environ["B"] = "2"\ndel os.environ["B"]\n'
           'os.putenv("C", "3")\nif True:\n    os.environ.update(D="4")\n'
           'def f():\n    os.environ["E"] = "5"\n')
    assert _module_level_mutations(ast.parse(src)) == [2, 3, 4, 5, 7]
