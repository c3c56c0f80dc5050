"""The package's layering: every module imports only from its own layer's unit or from layers below it, and no
import cycle exists between modules (function-level imports count too)."""

from __future__ import annotations

import ast
from pathlib import Path

import draftwise

PACKAGE = Path(draftwise.__file__).parent

#: Units of the package from the bottom up. A unit may import its own modules and any unit of a lower layer.
LAYERS: list[set[str]] = [
    {"errors"},
    {"files"},  # reading the files a user names, with clear errors
    {"backend"},
    {"models"},  # loading checkpoints: model drafters load their draft model with it
    {"decoding"},
    {"drafters"},
    {"api"},
    {"bench", "doctor"},
    {"corpus", "serve"},
    {"cli"},
]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(path: Path) -> set[str]:
    """Every draftwise module ``path`` imports, resolved to absolute names."""
    module = module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "draftwise":
                continue
            # ``from . import x`` may name a module: count it when one exists.
            for alias in node.names:
                candidate = f"{target}.{alias.name}"
                found.add(candidate if candidate in MODULES else target)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.split(".")[0] == "draftwise")
    found.discard(module)
    return {name for name in found if name in MODULES}


MODULES = {module_name(path): path for path in PACKAGE.rglob("*.py")}


def unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def layer(module: str) -> int:
    name = unit(module)
    for index, units in enumerate(LAYERS):
        if name in units:
            return index
    return len(LAYERS)  # the package's __init__ sits on top


def test_every_unit_has_a_layer():
    assert {unit(module) for module in MODULES} - {""} <= set().union(*LAYERS)


def test_no_module_imports_a_higher_layer_or_a_sibling_unit():
    wrong = []
    for module, path in MODULES.items():
        for imported in imported_modules(path):
            if module == "draftwise":
                continue
            same_unit = unit(imported) == unit(module)
            if not same_unit and layer(imported) >= layer(module):
                wrong.append(f"{module} imports {imported}")
    assert not wrong, "layering broken:\n" + "\n".join(sorted(wrong))


def test_no_import_cycle():
    graph = {module: imported_modules(path) for module, path in MODULES.items()}
    # A package's __init__ re-exports its modules: only cycles through plain modules count.
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(module: str, stack: list[str]) -> None:
        state[module] = 1
        for imported in graph[module]:
            if MODULES[imported].name == "__init__.py" and imported in module:
                continue  # a module importing its own package's __init__ (for shared names) is not a cycle
            if state.get(imported) == 1:
                cycles.append([*stack[stack.index(imported):], imported] if imported in stack else [module, imported])
            elif imported not in state:
                visit(imported, [*stack, imported])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(cycle) for cycle in cycles)
