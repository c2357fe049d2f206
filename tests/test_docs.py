"""Every file path and every ``python -m`` module the docs cite exists, so that a move in the
code shows up as a failing test rather than as a stale line a new user trips over.

Scanned: README.md, docs/*.md, and the comments of the Dockerfile and of every file under
deploy/. A path there is relative to the repository root, or, for code, to src/logitserve/
(``server/ops/`` is src/logitserve/server/ops/); ``logitserve/...`` is the installed package,
src/logitserve/... (docs/DESIGN.md, "Layers and import rules", states the convention). A word
with a slash is taken for a path when it ends with ``/``, ends in a file extension the repository
uses, or starts with one of the repository's folders (``deploy/gpu``); one whose first part has a
dot is a host name (``docker.io/...``), and one followed by ``*``, ``{`` or ``<`` is a pattern.
``python -m bench.NAME`` and ``python -m logitserve.X.Y`` must name a module, or a package with
a ``__main__``.
"""

from __future__ import annotations

import pathlib
import re
import sys
from dataclasses import dataclass

ROOT = pathlib.Path(__file__).resolve().parent.parent
CODE = ROOT / "src" / "logitserve"
# Where a cited path may resolve: the root; src/ for the installed package's own paths
# (``logitserve/server/healthcheck.py``); src/logitserve/ for code (``server/ops/``).
BASES = (ROOT, ROOT / "src", CODE)
EXTENSIONS = {".py", ".pyi", ".sh", ".md", ".proto", ".yaml", ".yml", ".json", ".toml", ".txt", ".cfg"}
# A word with a slash, not part of a longer path, URL or variable (``$VIRTUAL_ENV/...``, ``~/x``).
PATH_WORD = re.compile(r"(?<![\w./\-~$@])([A-Za-z_][\w.\-]*/[\w./\-]*)")
MODULE_COMMAND = re.compile(r"(?<![\w-])-m\s+((?:bench|logitserve)(?:\.\w+)*)")


@dataclass(frozen=True)
class Citation:
    file: str  # relative to the root
    line: int
    text: str  # the path or the module, as cited


def folder_names() -> set[str]:
    """The folders a bare path may start with: the root's and src/logitserve/'s."""
    return {p.name for base in (ROOT, CODE) for p in base.iterdir() if p.is_dir() and not p.name.startswith(".")}


def paths_in(text: str, folders: set[str]) -> list[str]:
    """The words of ``text`` that look like repository paths (the module docstring's rule)."""
    found = []
    for match in PATH_WORD.finditer(text):
        if text[match.end():match.end() + 1] in ("*", "{", "<"):
            continue  # a pattern: tests/test_*.py, bench/{a,b}.py, docs/<name>.md
        word = match.group(1).rstrip(".,:;")
        first, _, rest = word.partition("/")
        if "." in first or not word:
            continue
        if word.endswith("/") or pathlib.PurePosixPath(word).suffix in EXTENSIONS or (first in folders and rest):
            found.append(word)
    return found


def comment_of(line: str) -> str:
    """The comment part of a Dockerfile or YAML line: from a ``#`` that starts the line or
    follows a space; empty where there is none."""
    stripped = line.lstrip()
    if stripped.startswith("#"):
        return stripped
    at = line.find(" #")
    return line[at + 1:] if at >= 0 else ""


def scanned_lines() -> list[tuple[str, int, str]]:
    """(file, line number, text) of every line the docs cite paths in."""
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    commented = [ROOT / "Dockerfile", *sorted(p for p in (ROOT / "deploy").rglob("*") if p.is_file())]
    lines = []
    for path in docs + commented:
        name = path.relative_to(ROOT).as_posix()
        for number, line in enumerate(path.read_text().splitlines(), 1):
            lines.append((name, number, line if path in docs else comment_of(line)))
    return lines


def resolves(path: str) -> bool:
    """A file, or a folder holding a file (an empty folder a move left behind, or one holding
    only ``__pycache__``, is not in a clone), under one of the bases."""
    for base in BASES:
        where = base / path
        if where.is_file() or (where.is_dir() and any(f.is_file() and "__pycache__" not in f.parts
                                                      for f in where.rglob("*"))):
            return True
    return False


def module_exists(module: str) -> bool:
    """``python -m module`` from the root would find it: a module file, or a package that has
    ``__main__.py`` (bench from the root, logitserve from src/). A part in capitals is a
    placeholder (``bench.NAME``): any module of the package before it will do."""
    parts = module.split(".")
    if any(part.isupper() for part in parts):
        parts = parts[:next(i for i, part in enumerate(parts) if part.isupper())]
        return (ROOT if parts[0] == "bench" else ROOT / "src").joinpath(*parts).is_dir()
    base = ROOT if parts[0] == "bench" else ROOT / "src"
    where = base.joinpath(*parts)
    return where.with_suffix(".py").is_file() or (where / "__main__.py").is_file()


def test_the_scan_finds_paths_and_leaves_prose_alone():
    folders = {"server", "tests", "deploy", "kernels"}
    line = ("see `server/ops/` and tests/test_auth.py, (deploy/gpu), protos/logitserve/v1/x.proto; "
            "not calls/s, HTTP/2, docker.io/library/x.py, tests/test_*.py, $VIRTUAL_ENV/healthcheck.py, "
            "https://github.com/grpc/grpc/blob/x.py or path/to/checkpoint")
    assert paths_in(line, folders) == ["server/ops/", "tests/test_auth.py", "deploy/gpu",
                                       "protos/logitserve/v1/x.proto"]
    assert comment_of("    CMD [\"x\"]  # asks server/healthcheck.py") == "# asks server/healthcheck.py"
    assert comment_of("RUN ln -s a/b.py c") == ""
    assert resolves("server/ops/") and resolves("tests/test_docs.py") and resolves("logitserve/server/app.py")
    assert not resolves("server/ops.py")
    assert module_exists("bench.load") and module_exists("logitserve.server.process")
    assert module_exists("bench.NAME") and not module_exists("bench.nothing.NAME")
    assert not module_exists("bench.nothing_here") and not module_exists("logitserve.server")


def test_a_folder_without_files_is_not_cited_as_one(tmp_path, monkeypatch):
    (tmp_path / "left" / "__pycache__").mkdir(parents=True)  # what a move leaves behind
    (tmp_path / "left" / "__pycache__" / "gone.cpython-311.pyc").write_bytes(b"")
    (tmp_path / "kept").mkdir()
    (tmp_path / "kept" / "a.py").write_text("")
    monkeypatch.setattr(sys.modules[__name__], "BASES", (tmp_path,))
    assert resolves("kept/") and resolves("kept/a.py")
    assert not resolves("left/") and not resolves("nowhere/")


def test_every_cited_path_exists():
    folders = folder_names()
    missing = [Citation(name, number, path) for name, number, text in scanned_lines()
               for path in paths_in(text, folders) if not resolves(path)]
    assert not missing, (f"{len(missing)} cited paths exist neither under the root nor under src/logitserve/:\n"
                         + "\n".join(f"{c.file}:{c.line}: {c.text}" for c in missing))


def test_every_cited_module_command_names_a_module():
    missing = [Citation(name, number, match.group(1)) for name, number, text in scanned_lines()
               for match in MODULE_COMMAND.finditer(text) if not module_exists(match.group(1))]
    assert not missing, (f"{len(missing)} `python -m` commands name no runnable module:\n"
                         + "\n".join(f"{c.file}:{c.line}: python -m {c.text}" for c in missing))
