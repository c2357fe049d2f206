"""The import rules of docs/DESIGN.md ("Layers and import rules"), checked on every import of
src/logitserve/, those inside functions included: which package may import which, the server's
layers (no import from a lower layer to a higher one), the kernels' public names only; and no
module over 400 lines, in src/, tests/, bench/, examples/ and scripts/."""

from __future__ import annotations

import ast
import pathlib

SRC = pathlib.Path(__file__).resolve().parent.parent / "src"
MAX_LINES = 400
# What each package of ours may import of ours (beside itself).
PACKAGES = {
    "kernels": set(),
    "v1": set(),
    "kserve": set(),
    "reflection_v1": set(),
    "client": {"v1"},
    "server": {"kernels", "v1", "kserve", "reflection_v1"},
}
# The server's layers, top first; a module imports its own layer and those below.
SERVER_LAYERS = (
    ("entry points", ("app", "cli", "flags", "flag_table", "process", "workers", "devices", "testing", "healthcheck", "precompile",
                      "__init__")),
    ("front doors", ("api",)),
    ("sessions", ("sequences", "ordered")),
    ("operators", ("ops",)),
    ("machinery", ("engine",)),
    ("tensors", ("tensors",)),
    ("regions", ("regions",)),
    ("shared", ("config", "errors", "identity", "logs", "metrics", "tenancy", "version", "wire")),
)


def module_name(path: pathlib.Path, src: pathlib.Path = SRC) -> str:
    parts = path.relative_to(src).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: pathlib.Path, src: pathlib.Path = SRC) -> list[tuple[int, str]]:
    """(line, absolute module) of every import in ``path``; ``from X import name`` counts as
    ``X.name`` (a submodule or a name of X: the layer check treats both alike)."""
    name = module_name(path, src)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module
            found += [(node.lineno, f"{origin}.{alias.name}") for alias in node.names]
    return [(line, name) for line, name in found if name.startswith("logitserve.")]


def server_layer(module: str) -> int | None:
    """Index in SERVER_LAYERS of a ``logitserve.server.*`` module (None: not a server module)."""
    parts = module.split(".")
    if parts[:2] != ["logitserve", "server"]:
        return None
    top = parts[2] if len(parts) > 2 else "__init__"
    for index, (_, members) in enumerate(SERVER_LAYERS):
        if top in members:
            return index
    raise AssertionError(f"{module}: in no layer of tests/test_layers.py (add it, and to docs/DESIGN.md)")


def sources(src: pathlib.Path = SRC) -> list[pathlib.Path]:
    return sorted(p for p in (src / "logitserve").rglob("*.py") if not p.name.endswith(("_pb2.py", "_pb2_grpc.py")))


def upward_imports(src: pathlib.Path = SRC) -> list[str]:
    wrong = []
    for path in sources(src):
        own = server_layer(module_name(path, src))
        if own is None:
            continue
        for line, name in imports_of(path, src):
            layer = server_layer(name)
            if layer is not None and layer < own:
                wrong.append(f"{path.relative_to(src)}:{line} ({SERVER_LAYERS[own][0]}) imports {name} "
                             f"({SERVER_LAYERS[layer][0]})")
    return wrong


def test_packages_import_only_what_design_allows():
    wrong = []
    for path in sources():
        package = module_name(path).split(".")[1] if "." in module_name(path) else None
        if package is None:
            continue
        for line, name in imports_of(path):
            target = name.split(".")[1]
            if target != package and target not in PACKAGES[package]:
                wrong.append(f"{path.relative_to(SRC)}:{line} imports {name}")
            if package == "server" and target == "kernels" and any(p.startswith("_") for p in name.split(".")[2:]):
                wrong.append(f"{path.relative_to(SRC)}:{line} reaches into a private name: {name}")
    assert not wrong, wrong


def test_no_server_module_imports_a_higher_layer():
    wrong = upward_imports()
    assert not wrong, wrong


def test_the_checker_catches_an_upward_import_inside_a_function(tmp_path):
    engine = tmp_path / "logitserve" / "server" / "engine"
    engine.mkdir(parents=True)
    (engine / "batcher.py").write_text("def later():\n    from ..api import guard\n")
    assert upward_imports(tmp_path) == ["logitserve/server/engine/batcher.py:2 (machinery) imports "
                                        "logitserve.server.api.guard (front doors)"]


def test_no_module_over_400_lines():
    root = SRC.parent
    modules = [*sources(), *(p for folder in ("tests", "bench", "examples", "scripts") for p in (root / folder).rglob("*.py"))]
    long = [f"{p.relative_to(root)}: {n}" for p in modules if (n := len(p.read_text().splitlines())) > MAX_LINES]
    assert not long, long
