"""The import layers: what may import what.

The bootstrap is a small control-plane service: it must start without torch and
without the node framework, so ``python -m bootstrap --help`` stays fast and its
image stays small. ``shared/`` serves every role and so imports none of them; its
own parts stand in layers (``SHARED_LAYERS``), each importing only those below, so a
lower part is read, tested and changed without the parts above it.
Imports inside functions are counted, since a call can run them. Imports under
``if TYPE_CHECKING:`` do not run: the bootstrap's check skips them, the checks of
``shared/`` count them, as a type from a layer above ties the layers all the same.
"""

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
ROLES = ("bootstrap", "prefill_node", "decode_node", "kvroom_vllm", "launcher", "bench", "tests")
# shared/ bottom to top: a module may import its own layer and those below it, never one above.
SHARED_LAYERS = (
    "shared.errors",
    "shared.cli",
    "shared.logs",
    "shared.heap",
    "shared.settings",
    "shared.kv",
    "shared.room",
    "shared.metrics",
    "shared.wire",
    "shared.models",
    "shared.node",
)


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_of(path: pathlib.Path, type_checking: bool = False) -> set[str]:
    """Every module a file may import at run time, as dotted names; with ``type_checking``,
    those under ``if TYPE_CHECKING:`` too."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node) and not type_checking:
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return found


def project_files() -> dict[str, pathlib.Path]:
    files = {}
    for top in ("bootstrap", "shared", "prefill_node", "decode_node", "launcher"):
        for path in (ROOT / top).rglob("*.py"):
            files[_module_name(path)] = path
    return files


def reachable_from(roots: list[str], files: dict[str, pathlib.Path]) -> dict[str, str]:
    """Every name imported, transitively through project modules, with the module that imports it."""
    seen: dict[str, str] = {}
    todo = list(roots)
    visited: set[str] = set()
    while todo:
        module = todo.pop()
        if module in visited:
            continue
        visited.add(module)
        for name in imports_of(files[module]):
            seen.setdefault(name, module)
            parts = name.split(".")
            # Importing a.b.c runs a/__init__, a/b/__init__ and a/b/c.
            for end in range(1, len(parts) + 1):
                prefix = ".".join(parts[:end])
                if prefix in files and prefix not in visited:
                    todo.append(prefix)
    return seen


def _under(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


FORBIDDEN_FOR_BOOTSTRAP = ("torch", "transformers", "mooncake", "shared.node", "prefill_node", "decode_node")


def test_the_bootstrap_never_reaches_torch_the_node_framework_or_a_role():
    files = project_files()
    roots = [name for name in files if _under(name, "bootstrap")]
    reached = reachable_from(roots, files)
    bad = {
        name: importer
        for name, importer in reached.items()
        if any(_under(name, forbidden) for forbidden in FORBIDDEN_FOR_BOOTSTRAP)
    }
    assert not bad, f"the bootstrap reaches {bad}"


def test_nothing_under_shared_imports_a_role():
    files = project_files()
    bad = {
        module: sorted(
            name for name in imports_of(path, type_checking=True) if any(_under(name, role) for role in ROLES)
        )
        for module, path in files.items()
        if _under(module, "shared")
    }
    bad = {module: names for module, names in bad.items() if names}
    assert not bad, f"shared imports a role: {bad}"


def layer_of(name: str) -> int | None:
    return next((i for i, layer in enumerate(SHARED_LAYERS) if _under(name, layer)), None)


def test_every_module_of_shared_has_a_layer():
    files = project_files()
    unlayered = [
        name for name in files if _under(name, "shared") and name != "shared" and layer_of(name) is None
    ]
    assert not unlayered, f"add these to SHARED_LAYERS: {unlayered}"


def test_shared_imports_only_its_own_layer_and_those_below():
    upward = []
    for module, path in project_files().items():
        own = layer_of(module)
        names = imports_of(path, type_checking=True)
        for name in sorted(names):
            layer = layer_of(name)
            parent = name.rpartition(".")[0]
            named_already = parent in names and layer_of(parent) == layer  # `from a.b import c`: a.b, a.b.c
            if own is not None and layer is not None and layer > own and not named_already:
                upward.append(f"{module} -> {name}")
    assert not upward, "shared imports a layer above its own:\n" + "\n".join(upward)


def test_the_checker_sees_a_lazy_import(tmp_path, monkeypatch):
    """The walk counts an import inside a function, and one under TYPE_CHECKING only when asked."""
    source = tmp_path / "probe.py"
    source.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import numpy\n"
        "def f():\n    from shared.node import rank\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert "shared.node.rank" in imports_of(source)
    assert "numpy" not in imports_of(source)
    assert "numpy" in imports_of(source, type_checking=True)


@pytest.mark.parametrize("entry", ["bootstrap", "bootstrap.app"])
def test_importing_the_bootstrap_loads_no_torch(entry):
    code = f"import sys, importlib; importlib.import_module({entry!r}); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
