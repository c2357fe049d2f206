"""README.md's flag table is the one logitserve.server.flag_table makes from `logitserve serve`'s
parser: every flag, its variable, its default and its help string, so the README cannot drift
from the flags (it lacked --compile-processes, --compile-cache-dir and --token-share, and said
nothing of --warmup-widths' CPU default)."""

from __future__ import annotations

import pathlib

import pytest

from logitserve.server import cli, flag_table

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_table_is_the_generated_one():
    text = README.read_text()
    assert flag_table.rewrite(text) == text, (
        f"README.md's flag table differs from the flags' help strings in cli.py: run "
        f"`{flag_table.COMMAND}` from the repository root and commit README.md")


def test_a_row_per_flag_with_its_variable_default_and_help():
    rows = {flag: (variable, default, meaning) for flag, variable, default, meaning in flag_table.rows()}
    assert list(rows) == [flag for flag, *_ in cli.FLAGS]
    assert rows["--port"] == ("LOGITSERVE_PORT", "50051",
                              "port to listen on (0 picks a free one; the listening log line says which)")
    assert rows["--warmup-widths"][1] == "auto" and "64 otherwise" in rows["--warmup-widths"][2]
    assert rows["--grace-period-s"][1] == "10" and rows["--tls-cert"][1] == "unset"
    table = flag_table.markdown()
    assert "| `--token-share` | `LOGITSERVE_TOKEN_SHARE` | `0.5` | with `--auth-token-file`, the share" in table
    assert "| `--compile-cache-dir` | `LOGITSERVE_COMPILE_CACHE_DIR` | unset |" in table


def test_a_flag_added_to_the_parser_gets_its_row(monkeypatch):
    extra = ("--test-only-knob", int, 7, "a knob | with a pipe, after --port <and a tag>")
    monkeypatch.setattr(cli, "FLAGS", (*cli.FLAGS, extra))
    row = flag_table.markdown().splitlines()[-1]
    assert row == ("| `--test-only-knob` | `LOGITSERVE_TEST_ONLY_KNOB` | `7` | a knob \\| with a pipe, after `--port` "
                   "&lt;and a tag> |")


def test_rewrite_replaces_only_between_the_markers():
    text = f"# title\n\nbefore\n{flag_table.BEGIN}\n| old | table |\n{flag_table.END}\nafter\n"
    new = flag_table.rewrite(text)
    assert new.startswith("# title\n\nbefore\n") and new.endswith(f"{flag_table.END}\nafter\n")
    assert "| old | table |" not in new and flag_table.markdown() in new
    assert flag_table.rewrite(new) == new


def test_rewrite_without_markers_says_where_they_go():
    with pytest.raises(ValueError, match="no flag table markers"):
        flag_table.rewrite("# a README with no table\n")


def test_the_command_rewrites_a_readme(tmp_path, capsys):
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{flag_table.BEGIN}\nstale\n{flag_table.END}\n")
    assert flag_table.main([str(readme)]) == 0
    assert flag_table.rewrite(readme.read_text()) == readme.read_text() and "stale" not in readme.read_text()
    assert "rewritten" in capsys.readouterr().out
    assert flag_table.main([str(readme)]) == 0
    assert "already current" in capsys.readouterr().out
