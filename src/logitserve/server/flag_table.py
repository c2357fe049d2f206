"""README.md's table of ``logitserve serve``'s flags, made from the parser, so each flag is described
once (its help string in cli.py's FLAGS) and the table cannot drift from the flags there are.

    python -m logitserve.server.flag_table [README.md]   # rewrite the table between its markers

tests/test_flag_table.py fails while README.md's table differs from what this makes.
"""

from __future__ import annotations

import argparse
import pathlib
import re
import sys

from .cli import build_parsers
from .flags import env_name, shown_default

COMMAND = "python -m logitserve.server.flag_table"
BEGIN = f"<!-- generated from logitserve serve's parser by `{COMMAND}`: edit the flags' help in flags.py -->"
END = "<!-- end of the generated flag table -->"
_FLAG = re.compile(r"(?<![\w`-])(--[a-z][a-z0-9-]*)")


def rows() -> list[tuple[str, str, str, str]]:
    """``(flag, variable, default, meaning)`` of each of serve's flags, in ``--help``'s order: the
    meaning is the help string without the ``[variable; default: ...]`` the parser adds to it."""
    _, serve = build_parsers({})
    table = []
    for action in serve._actions:
        if action.dest == "help":
            continue
        flag = action.option_strings[0]
        variable, default = env_name(flag), shown_default(action.default)
        table.append((flag, variable, default, action.help.removesuffix(f" [{variable}; default: {default}]")))
    return table


def _cell(text: str) -> str:
    """``text`` in a Markdown table cell: flags as code; a pipe would end the cell, ``<`` open a tag."""
    return _FLAG.sub(r"`\1`", text.replace("|", "\\|").replace("<", "&lt;"))


def markdown() -> str:
    """The table, one row a flag; defaults as code, but ``unset`` (no value) as a word."""
    lines = ["| flag | variable | default | meaning |", "|---|---|---|---|"]
    for flag, variable, default, meaning in rows():
        shown = default if default == shown_default(None) else f"`{default}`"
        lines.append(f"| `{flag}` | `{variable}` | {shown} | {_cell(meaning)} |")
    return "\n".join(lines)


def rewrite(readme: str) -> str:
    """``readme`` with the text between the BEGIN and END markers replaced by :func:`markdown`."""
    head, begin, rest = readme.partition(BEGIN)
    _, end, tail = rest.partition(END)
    if not (begin and end):
        raise ValueError(f"no flag table markers in the README: put\n{BEGIN}\n{END}\nwhere the table goes")
    # blank lines around the table: Markdown ends a table at the next block, an HTML comment too
    return f"{head}{BEGIN}\n\n{markdown()}\n\n{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=COMMAND, description="Rewrite the flag table of a README "
                                     "(README.md) from logitserve serve's parser.")
    parser.add_argument("readme", nargs="?", default="README.md", type=pathlib.Path)
    path = parser.parse_args(argv).readme
    text = path.read_text()
    try:
        new = rewrite(text)
    except ValueError as exc:
        parser.error(f"{path}: {exc}")
    if new != text:
        path.write_text(new)
    print(f"{path}: flag table {'rewritten' if new != text else 'already current'} ({len(rows())} flags)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
