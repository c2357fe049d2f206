"""`logitserve serve`'s usage errors: each in serve's usage (a range error once came with the
top-level usage, after 2-3 s importing torch), naming the flag or the LOGITSERVE_* variable the
value came from; a misspelled flag gets the nearest one; a TLS or token file that cannot be read
is named with its flag; and none of it imports torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from logitserve.server import cli

SERVE_USAGE = "usage: logitserve serve "


def serve_error(capsys, argv, environ=None) -> str:
    """The error line of ``logitserve serve ARGV`` (exit 2 with serve's usage) under ``environ``."""
    with pytest.raises(SystemExit) as info:
        cli.parse(["serve", *argv], environ or {})
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.startswith(SERVE_USAGE), err
    return err.strip().splitlines()[-1]


@pytest.mark.parametrize("argv, environ, message", [
    (["--port", "70000"], {}, "--port: must be in [0, 65535], got 70000"),
    ([], {"LOGITSERVE_PORT": "70000"}, "LOGITSERVE_PORT (--port): must be in [0, 65535], got 70000"),
    (["--port", "x"], {}, "argument --port: invalid int value: 'x'"),
    ([], {"LOGITSERVE_MAX_ROWS": "many"}, "LOGITSERVE_MAX_ROWS (--max-rows): 'many' is not a valid value"),
    (["--warmup-dtypes", "float8"], {}, "--warmup-dtypes: ['float8'] not in float16, bfloat16, float32, float64"),
    ([], {"LOGITSERVE_WARMUP_DTYPES": "float8"}, "LOGITSERVE_WARMUP_DTYPES (--warmup-dtypes): ['float8'] not in"),
    (["--tls-cert", "c.pem"], {}, "--tls-cert and --tls-key: give both or neither"),
])
def test_value_errors_in_serves_usage_naming_the_flag_or_variable(argv, environ, message, capsys):
    assert message in serve_error(capsys, argv, environ)


@pytest.mark.parametrize("argv, message", [
    (["--prot", "1"], "unrecognized arguments: --prot 1; --prot: did you mean --port?"),
    (["--max-qeue=5"], "unrecognized arguments: --max-qeue=5; --max-qeue: did you mean --max-queue?"),
    (["-port", "1"], "-port: did you mean --port?"),
    (["--devcie", "cpu", "--tls-certs", "c.pem"], "--devcie: did you mean --device?; --tls-certs: did you mean "
                                                  "--tls-cert?"),
    (["--verbose"], "unrecognized arguments: --verbose"),  # nothing near it: no guess
    (["stray"], "unrecognized arguments: stray"),
])
def test_a_misspelled_flag_gets_the_nearest_one(argv, message, capsys):
    line = serve_error(capsys, argv)
    assert line.endswith(message), line


def test_an_unknown_argument_to_version_keeps_the_top_level_usage(capsys):
    with pytest.raises(SystemExit):
        cli.parse(["version", "--x"], {})
    assert capsys.readouterr().err.startswith("usage: logitserve [-h]")


@pytest.fixture
def files(tmp_path):
    """A certificate, key, CA bundle and token file that exist (their contents are never read here)."""
    for name in ("cert.pem", "key.pem", "ca.pem", "tokens"):
        (tmp_path / name).write_text("x\n")
    return tmp_path


@pytest.mark.parametrize("flag", ["--tls-cert", "--tls-key", "--tls-client-ca", "--auth-token-file"])
def test_a_file_that_cannot_be_read_is_named_with_its_flag(flag, files, capsys):
    given = {"--tls-cert": files / "cert.pem", "--tls-key": files / "key.pem", "--tls-client-ca": files / "ca.pem",
             "--auth-token-file": files / "tokens", flag: files / "missing"}
    argv = ["serve", "--device", "cpu", *(str(a) for pair in given.items() for a in pair)]
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.startswith(SERVE_USAGE), err
    assert err.strip().splitlines()[-1].endswith(f"{flag}: cannot read {files / 'missing'}: No such file or directory")


def test_a_file_from_the_environment_is_named_with_its_variable(files, capsys, monkeypatch):
    monkeypatch.setenv("LOGITSERVE_AUTH_TOKEN_FILE", str(files))  # a directory
    with pytest.raises(SystemExit) as info:
        cli.main(["serve", "--device", "cpu"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.startswith(SERVE_USAGE), err
    assert err.strip().endswith(f"LOGITSERVE_AUTH_TOKEN_FILE (--auth-token-file): cannot read {files}: Is a directory")


def test_no_error_imports_torch(tmp_path):
    """Each error is reported before torch is imported (2-3 s on a 2-core machine): torch is not in
    sys.modules when ``main`` exits. One interpreter, cases in order, so the first that imports
    torch is the one named."""
    cases = [(["serve", "--port", "70000"], {}), (["serve"], {"LOGITSERVE_PORT": "70000"}),
             (["serve", "--port", "x"], {}), (["serve", "--prot", "1"], {}),
             (["serve", "--max-queue", "0", "--device", "cpu"], {}),
             (["serve", "--tls-cert", str(tmp_path / "no.pem"), "--tls-key", str(tmp_path / "no.key")], {}),
             (["serve"], {"LOGITSERVE_AUTH_TOKEN_FILE": str(tmp_path / "none")})]
    script = ("import json, os, sys\nfrom logitserve.server import cli\nseen = []\n"
              "for argv, environ in json.loads(sys.argv[1]):\n"
              "    os.environ.update(environ)\n"
              "    try:\n        cli.main(argv)\n    except SystemExit as exc:\n"
              "        seen.append([exc.code, 'torch' in sys.modules])\n"
              "    for name in environ:\n        del os.environ[name]\n"
              "print(json.dumps(seen))\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOGITSERVE_")}
    done = subprocess.run([sys.executable, "-c", script, json.dumps(cases)], capture_output=True, text=True,
                          timeout=120, env=env)
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen == [[2, False]] * len(cases), list(zip([c[0] for c in cases], seen))
