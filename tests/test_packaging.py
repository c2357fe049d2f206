"""Every package of the source tree ships: pyproject.toml lists each folder with an __init__.py.

A non-editable install (the container image) copies only the packages pyproject.toml names; a
subpackage missing from the list works in the editable test install and fails in the image.
"""

from __future__ import annotations

import pathlib
import tomllib

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_every_package_folder_is_listed():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {folder: name for name, folder in setuptools["package-dir"].items()}
    listed = set(setuptools["packages"])
    found = set()
    for init in ROOT.glob("**/__init__.py"):
        folder = init.parent.relative_to(ROOT).as_posix()
        top = next((f for f in sorted(folders, key=len, reverse=True) if folder == f or folder.startswith(f + "/")),
                   None)
        if top is not None:
            found.add(folders[top] + folder[len(top):].replace("/", "."))
    assert found - listed == set(), "packages missing from pyproject.toml [tool.setuptools] packages"
    assert listed <= found, "pyproject.toml lists packages that have no folder"
