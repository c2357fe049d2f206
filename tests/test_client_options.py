"""What a client is made with and what ``help()`` shows of it: ``channel="shm"`` refused when the
client is made where iceoryx2 of the server's release cannot run (missing, or another release),
with the command that installs it; that release the same in the client, the server and
pyproject.toml; ``Client.sample``'s signature naming every argument; docs/SERVICE.md's
``Client(...)`` the constructor's.
"""

from __future__ import annotations

import inspect
import os
import pathlib
import pydoc
import re
import subprocess
import sys
import tomllib

from logitserve.client import AsyncClient, Client, arguments, messages

ROOT = pathlib.Path(__file__).resolve().parent.parent
# Made in a fresh interpreter (the iceoryx2 it sees set up by the test): the error's message, or "made".
MAKE_SHM_CLIENT = """
from logitserve.client import Client
try:
    Client("127.0.0.1:1", channel="shm")
except ImportError as exc:
    print(exc)
else:
    print("made")
Client("127.0.0.1:1").close()  # a gRPC client needs none of it
"""


def _make_shm_client(prelude: str = "", pythonpath: pathlib.Path | None = None) -> str:
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(pythonpath), env.get("PYTHONPATH")]))
    out = subprocess.run([sys.executable, "-c", prelude + MAKE_SHM_CLIENT], capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_a_shm_client_without_iceoryx2_is_refused_when_made():
    message = _make_shm_client("import sys; sys.modules['iceoryx2'] = None\n")
    assert message.startswith("channel='shm': the same-host channel needs iceoryx2 0.10.0 (the server's release) "
                              "in this Python, which has none that imports ("), message
    assert message.endswith(": pip install 'logitserve[channel]'"), message


def test_a_shm_client_with_another_iceoryx2_release_is_refused_when_made(tmp_path):
    (tmp_path / "iceoryx2").mkdir()
    (tmp_path / "iceoryx2" / "__init__.py").write_text("")
    (tmp_path / "iceoryx2-0.9.0.dist-info").mkdir()
    (tmp_path / "iceoryx2-0.9.0.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: iceoryx2\nVersion: 0.9.0\n")
    assert _make_shm_client(pythonpath=tmp_path) == (
        "channel='shm': the same-host channel needs iceoryx2 0.10.0 (the server's release) in this Python, which "
        "has iceoryx2 0.9.0: pip install 'logitserve[channel]'")


def test_a_shm_client_is_made_where_iceoryx2_runs():
    assert _make_shm_client() == "made"


def test_the_client_server_and_pyproject_pin_one_iceoryx2_release():
    from logitserve.server.api.channel import transport

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    pinned = {requirement for extra in ("channel", "server") for requirement in extras[extra]
              if requirement.startswith("iceoryx2")}
    assert pinned == {f"iceoryx2=={arguments.ICEORYX2_VERSION}"}
    assert transport.ICEORYX2_VERSION == arguments.ICEORYX2_VERSION


def test_help_names_samples_every_argument():
    """``help(Client.sample)`` once showed ``**processors`` where ``sequence_ids=`` and the
    processors' lists are taken."""
    parameters = inspect.signature(Client.sample).parameters
    assert not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    shown = pydoc.render_doc(Client.sample, renderer=pydoc.plaintext)
    for name in ("sequence_ids", "repetition_penalty", "frequency_penalty", "presence_penalty", "min_tokens",
                 "logprobs", "logprobs_mode", "return_kept", "wait_for_ready", *messages.PROCESSOR_TENSORS):
        assert name in parameters, name
        assert f"{name}=" in shown and f"``{name}``" in inspect.getdoc(Client.sample), name


def test_the_constructor_shows_its_arguments_and_the_docs_name_them():
    """``help(Client)`` shows the constructor's keywords (not ``*args, **kwargs``), and
    docs/SERVICE.md's ``Client(...)`` lists the same, with the same defaults."""
    signature = inspect.signature(Client)
    assert inspect.signature(AsyncClient) == signature
    documented = re.search(r"`Client\((target, \*, [^`]*)\)`", (ROOT / "docs" / "SERVICE.md").read_text())
    assert documented, "docs/SERVICE.md: no `Client(target, *, ...)`"
    written = re.sub(r"\s+", " ", documented.group(1)).split(", ")
    assert written[:2] == ["target", "*"]
    in_docs = dict(part.split("=", 1) for part in written[2:])
    in_code = {name: p.default for name, p in signature.parameters.items() if name != "target"}
    assert list(in_docs) == list(in_code)
    for name, default in in_code.items():
        shown = "NEW_SCOPE" if name == "region_scope" else repr(default).replace("'", '"')
        assert in_docs[name] == shown, (name, in_docs[name], shown)
