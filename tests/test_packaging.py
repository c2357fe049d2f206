"""What the checkout puts on ``sys.path`` stands in for no installed package, and the wheel holds
every package of the source tree.

The code lives under ``src/logitserve/`` (the src layout). ``python -m pytest``, the README's
commands and ``python -m bench.*`` run from the checkout's root, which Python puts first on
``sys.path``; pytest puts ``tests/`` there too (its default import mode). A folder with an
``__init__.py`` or a module there, named like an installed distribution's top-level package,
is imported instead of it: a ``kernels/`` at the root once stood in for the hub's ``kernels``,
which transformers 5.25 imports, and every test that loaded a model failed. The first test fails,
naming both, whenever a dependency brings a package named like one of ours.

A non-editable install (the container image, a wheel) copies only the packages setuptools finds;
the second test builds the wheel and checks that every folder with an ``__init__.py`` under
``src/`` and every proto and stub file is in it.
"""

from __future__ import annotations

import importlib.metadata
import pathlib
import shutil
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SRC = ROOT / "src"
# The folders whose entries are importable by their bare names while the tests or the documented
# commands run: the root (python -m from the checkout) and tests/ (pytest's prepend import mode).
ON_SYS_PATH = (ROOT, ROOT / "tests")


def importable_names(folder: pathlib.Path) -> set[str]:
    """Top-level names ``folder`` provides on sys.path that can shadow an installed package: modules
    and regular packages (a folder without ``__init__.py`` is a namespace portion, which any
    installed regular package of that name wins over)."""
    names = {p.stem for p in folder.glob("*.py")}
    names |= {p.parent.name for p in folder.glob("*/__init__.py")}
    return names


def test_no_checkout_folder_stands_in_for_an_installed_package():
    installed = importlib.metadata.packages_distributions()
    clashes = [f"{folder.relative_to(ROOT).as_posix() or '.'}/{name} shadows the installed "
               f"{', '.join(sorted(set(installed[name])))}'s package {name!r}"
               for folder in ON_SYS_PATH for name in sorted(importable_names(folder))
               if name in installed and name != "logitserve"]
    assert not clashes, "rename these (or move them under src/logitserve/): " + "; ".join(clashes)


def test_the_root_holds_no_package_but_bench():
    """The only importable folder at the root is ``bench/`` (its commands are ``python -m
    bench.NAME`` from the root); the code is under ``src/``."""
    assert importable_names(ROOT) == {"bench"}


def test_the_wheel_holds_every_package(tmp_path):
    # Built from a copy of what the build reads, so that it writes nothing (build/) into the tree.
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, checkout / name)
    shutil.copytree(SRC, checkout / "src", ignore=shutil.ignore_patterns("__pycache__"))
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "--wheel-dir",
                           str(tmp_path), str(checkout)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"pip wheel failed (it needs setuptools from an index):\n{done.stderr[-3000:]}"
    (wheel,) = tmp_path.glob("logitserve-*.whl")
    shipped = set(zipfile.ZipFile(wheel).namelist())
    packages = {init.parent.relative_to(SRC).as_posix() for init in SRC.glob("**/__init__.py")}
    assert {"logitserve", "logitserve/server", "logitserve/client", "logitserve/kernels"} <= packages
    missing = sorted(p for p in packages if f"{p}/__init__.py" not in shipped)
    assert not missing, f"packages missing from the wheel: {missing}"
    data = {p.relative_to(SRC).as_posix() for suffix in ("*.proto", "*.pyi") for p in SRC.glob(f"**/{suffix}")}
    assert data and not sorted(data - shipped), f"proto and stub files missing from the wheel: {sorted(data - shipped)}"


def test_the_environment_is_what_constraints_txt_pins():
    """Every package scripts/venv.sh installed is at the version constraints.txt pins, so a fresh
    clone tests what was tested here; a dependency added or moved without the pins fails here."""
    if pathlib.Path(sys.prefix).resolve() != (ROOT / ".venv").resolve():
        pytest.skip(f"this environment ({sys.prefix}) was not made by scripts/venv.sh")
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            pins[canonical(name)] = version
    # Only name==version pins: a direct reference (name @ url) or logitserve itself would make a
    # fresh clone's install of the checkout unresolvable.
    assert all(version and " " not in name and "@" not in name for name, version in pins.items()) and \
        "logitserve" not in pins, "constraints.txt: name==version lines only, logitserve not among them"
    # torch is pinned apart (TORCH_SPEC) and brings its own build's packages (nvidia-* with CUDA).
    apart = {"torch", "logitserve", "pip", "setuptools", "wheel"}
    apart |= {canonical(requirement.split(";")[0].split()[0].split("=")[0].split(">")[0].split("<")[0])
              for requirement in importlib.metadata.requires("torch") or ()}
    wrong = sorted(f"{name} {dist.version} (pinned: {pins.get(name, 'not pinned')})"
                   for dist in importlib.metadata.distributions()
                   if (name := canonical(dist.metadata["Name"])) not in apart and pins.get(name) != dist.version)
    assert not wrong, f"run scripts/update_constraints.sh, then scripts/test.sh: {wrong}"


def canonical(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")
