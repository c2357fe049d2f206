"""Region names, shared-memory keys, owners, and the request messages' region fields: the
checks made before anything is opened or mapped."""

from __future__ import annotations

import hashlib
import re

SYSTEM = "system"
CUDA = "cuda"
KINDS = (SYSTEM, CUDA)

DEFAULT_MAX_REGIONS = 256
DEFAULT_MAX_MAPPED_BYTES = 16 << 30
SHM_DIR = "/dev/shm"
CUDA_IPC_HANDLE_BYTES = 64

# A region's name: what a RegionRef names, also in messages and logs.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")
NAME_RULE = "1 to 128 of A-Z a-z 0-9 . _ : -, starting with a letter or digit"
# A shared-memory object's name as shm_open takes it, without its optional leading '/'.
_KEY = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,254}")
KEY_RULE = "1 to 255 of A-Z a-z 0-9 . _ -, not starting with '.', after at most one leading '/'"


# The outputs each operator can write into regions (its request's output_regions keys): the
# fields of its answer.
OUTPUTS = {
    "Sample": ("token_ids", "seeds", "valid"),
    "RouteExperts": ("weights", "indices"),
    "Softmax": ("out",),
    "CausalSoftmax": ("out",),
    "Silu": ("out",),
    "VerifyDraft": ("token_ids", "num_accepted", "valid", "seeds"),
}


class RegionNotFound(Exception):
    """No region of that name visible to the caller: NOT_FOUND."""


class RegionExists(Exception):
    """A region of that name is already registered by the caller: ALREADY_EXISTS."""


def owner_of(authorization: str | None) -> str | None:
    """The owner of a caller's regions, from its ``authorization`` metadata value (``Bearer
    <token>``): a digest of the token, so the token itself is never kept; None without one."""
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    token = token.strip() if scheme.lower() == "bearer" else authorization.strip()
    return hashlib.sha256(token.encode("utf-8", "surrogateescape")).hexdigest() if token else None


# Which shared-memory objects a caller may map as system regions (--shm-key-scope). A server
# opens any object its own user can; a key alone proves nothing of who made it, so under
# "token" a caller may map only objects named with its token's prefix (key_prefix), which no
# other token can register: one token cannot reach another's memory, nor the server user's
# other objects. "any" is for servers without tokens, whose clients are all one identity.
KEY_SCOPE_ANY = "any"
KEY_SCOPE_TOKEN = "token"
KEY_SCOPES = (KEY_SCOPE_ANY, KEY_SCOPE_TOKEN)


def key_prefix(owner: str) -> str:
    """The prefix of every shared-memory key ``owner`` (owner_of's digest of a token) may
    register under the "token" scope: ``ls`` and 16 hex digits of a digest of the owner, then
    ``_``. A client computes it from its token (logitserve.client.key_prefix); the token cannot
    be read back from it."""
    return "ls" + hashlib.sha256(b"logitserve shm key prefix\0" + owner.encode()).hexdigest()[:16] + "_"


def check_key_scope(plain: str, owner: str | None, scope: str, field: str = "key") -> None:
    """``ValueError`` unless ``owner`` may map the object named ``plain`` under ``scope``. Decided
    on the name alone, before anything is opened, so a refusal says nothing of whether the
    object exists."""
    if scope == KEY_SCOPE_ANY:
        return
    if owner is None:
        raise ValueError(f"{field}: this server maps only shared-memory objects named with the caller's token "
                         f"prefix (--shm-key-scope token), and the call carries no bearer token")
    prefix = key_prefix(owner)
    if not plain.startswith(prefix):
        raise ValueError(f"{field}: must start with this token's prefix {prefix!r} (--shm-key-scope token: a "
                         f"client maps only objects named for its own token; create the object under such a "
                         f"name, e.g. key=Client.shm_key())")


def shown(text: str, limit: int = 64) -> str:
    """``repr(text)``, cut short: a hostile name can be long."""
    return repr(text if len(text) <= limit else text[:limit] + "...")


def check_name(name: str, field: str = "name") -> str:
    """``name`` when it is a valid region name, else ``ValueError``."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"{field}: {shown(str(name))} is not a valid region name ({NAME_RULE})")
    return name


def check_key(key: str, field: str = "key") -> str:
    """The shared-memory object's plain name for ``key`` (its leading '/' dropped), else
    ``ValueError``: never a path, never '.' or '..'."""
    plain = key[1:] if isinstance(key, str) and key.startswith("/") else key
    if not isinstance(plain, str) or not _KEY.fullmatch(plain):
        raise ValueError(f"{field}: {shown(str(key))} is not a plain shared-memory name ({KEY_RULE})")
    return plain


def region_of(tensor, field: str, data_bytes: int | None = None):
    """The ``RegionRef`` of a ``logitserve.v1.Tensor`` whose elements live in a region, or None
    for one that carries them in ``data``; ``ValueError`` when it has both. ``data_bytes``: the
    length of its data when read apart from the message (server/wire.py), else ``len(tensor.data)``."""
    if not tensor.HasField("region"):
        return None
    if (len(tensor.data) if data_bytes is None else data_bytes):
        raise ValueError(f"{field}: both data and region are set; exactly one holds the elements")
    return tensor.region


def check_outputs(output_regions, rpc: str, field: str = "output_regions") -> None:
    """``ValueError`` unless every key of a request's ``output_regions`` is an output of ``rpc``
    (:data:`OUTPUTS`) and every reference names a region."""
    known = OUTPUTS[rpc]
    for name, ref in output_regions.items():
        if name not in known:
            raise ValueError(f"{field}: {shown(name)} is not an output of {rpc} ({', '.join(known)})")
        if not ref.region:
            raise ValueError(f"{field}[{name}].region: required")


def kinds_of(kind: str | None) -> tuple[str, ...]:
    if kind is None or kind == "":
        return KINDS
    if kind not in KINDS:
        raise ValueError(f"kind: {kind!r} is not one of {', '.join(KINDS)}")
    return (kind,)

