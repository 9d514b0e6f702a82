"""No class of the package does too many jobs: at most 12 methods and 15 attributes (its
``self.x`` assignments and annotated class fields), the bar issue 52 set when the verifier
did six jobs in 13 methods and 19 attributes."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "vllm_ddtree"
MAX_METHODS, MAX_ATTRIBUTES = 12, 15


def class_sizes(source: str) -> dict[str, tuple[int, int]]:
    """Per class: (methods, attributes)."""
    sizes = {}
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ClassDef):
            continue
        methods = [n for n in node.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
        attributes = {n.target.id for n in node.body
                      if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
        attributes |= {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)
                       and isinstance(n.ctx, ast.Store) and isinstance(n.value, ast.Name)
                       and n.value.id == "self"}
        sizes[node.name] = (len(methods), len(attributes))
    return sizes


def test_the_counts_see_methods_and_attributes() -> None:
    source = ("class A:\n    x: int\n    def f(self):\n        self.y = self.z = 1\n"
              "    def g(self):\n        self.y = 2\n")
    assert class_sizes(source) == {"A": (2, 3)}


def test_no_class_is_over_the_bar() -> None:
    over = [f"{path.relative_to(PACKAGE)}:{name}: {methods} methods, {attributes} attributes"
            for path in sorted(PACKAGE.rglob("*.py"))
            for name, (methods, attributes) in class_sizes(path.read_text()).items()
            if methods > MAX_METHODS or attributes > MAX_ATTRIBUTES]
    assert not over, over
