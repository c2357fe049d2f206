"""Shared-memory regions: memory a client shares with the server, opened once at registration.

A region is a slice of a POSIX shared-memory object (system memory) or of a CUDA allocation
opened from its IPC handle (device memory). Tensors of a call name a slice of a region
(``logitserve.v1.RegionRef``) instead of carrying their bytes; :meth:`RegionRegistry.resolve`
turns such a reference into a lease on exactly that slice, checked:

    registry = RegionRegistry(max_regions=256, max_mapped_bytes=16 << 30)
    registry.register_system("logits", key="psm_1234", offset=0, byte_size=8 * 128256 * 4, owner=owner)
    with registry.resolve(ref, torch.float32, (8, 128256), owner, "logits") as lease:
        lease.copy_out()       # system: a new CPU tensor of dtype and shape, read from the object
        lease.read_into(buf)   # ... or into a buffer of the server's (a staging buffer)
        lease.write_from(t)    # system: an output's bytes, written into the object
        lease.tensor()         # CUDA: a torch tensor over the client's memory; a page-locked
                               # system region: its host tensor, for the device's copies only

The semantics are those of Triton Inference Server's shared-memory extension (its
``SystemSharedMemory*`` / ``CudaSharedMemory*`` RPCs map onto :meth:`~RegionRegistry.register_system`,
:meth:`~RegionRegistry.register_cuda`, :meth:`~RegionRegistry.status` and
:meth:`~RegionRegistry.unregister` with a ``kind``): a name registered twice fails
(:class:`RegionExists`), status and unregister of an empty name cover all of the caller's
regions, status of an unknown name fails (:class:`RegionNotFound`), unregistering an unknown name
unregisters nothing.

**Owners.** Every region belongs to an owner, :func:`owner_of` the caller's ``authorization``
metadata (None without a token). An owner sees, resolves and unregisters only its own regions;
two owners may use the same name. Limits (:class:`~.errors.TooLarge`) count every owner's.

**Keys.** A key names an object, but proves nothing of who made it, and the server can open any
object of its own user. With ``key_scope="token"`` (``--shm-key-scope``; the default when
tokens are on) an owner registers only keys that start with its :func:`key_prefix`, checked
before anything is opened: one token cannot map another's objects or the server user's others,
and a refusal does not tell whether a key exists. A CUDA region's capability is its IPC handle,
which only a process holding the allocation can export.

**Leases.** :meth:`~RegionRegistry.resolve` returns a :class:`RegionLease`; a region unregistered
while leased leaves the table at once (its name is free) and stays open until its last lease is
released. Whoever launches work on a lease releases the lease only once that work is complete
(for CUDA, after the stream synchronization that precedes the answer), and keeps no view of it
afterwards: the memory may be unmapped then.

**Safety.** A key is a plain name in the shared-memory namespace (``/dev/shm`` on Linux, where
``shm_open`` keeps its objects), opened with ``O_NOFOLLOW | O_NONBLOCK`` and refused unless a
regular file: nothing outside that namespace is ever opened. The server opens objects itself
(``os.open``), never through ``multiprocessing.shared_memory``, whose resource tracker
would unlink a client's object when the server's process ends. A client may shrink its object
at any moment, and bytes of a mapping past the new end fault (SIGBUS) when touched, whatever was
checked before: so no CPU code touches a system region through a mapping. Its bytes are read with
``os.preadv`` into the server's own memory and written with ``os.pwritev`` (access.py), which
cannot fault: a shrunk object fails the call (``ValueError`` naming the region), the server goes
on. Only a page-locked region (a CUDA server, pinning.py) is mapped, for the device's kernels
alone; a truncation takes its pages from the object but not from the device, so such a region
is refused once cut off (its last page gone from the server's page table) until registered again.

**Threads.** Every method may be called from the event loop and from a launch thread; a lock
guards the table, leases and counters. Opening a CUDA handle happens outside the lock.

Errors: :class:`RegionNotFound` (NOT_FOUND), :class:`RegionExists` (ALREADY_EXISTS), ``ValueError``
(INVALID_ARGUMENT; the message names the field and the rule), :class:`~.errors.TooLarge`
(RESOURCE_EXHAUSTED).

Modules, one concept each: names (names, keys, owners, the request messages' region fields),
region (a registered region, its status, a lease), system (opening a POSIX shared-memory
object), access (reading and writing one through its descriptor), pinning (page-locking it on a
CUDA server), cuda (opening a CUDA IPC handle), registry (the table, limits, resolving), calls
(the leases of one RPC on the request path), overlap (whether a Step's parts share memory).
"""

from .calls import CallRegions
from .names import (CUDA, CUDA_IPC_HANDLE_BYTES, DEFAULT_MAX_MAPPED_BYTES, DEFAULT_MAX_REGIONS, KEY_RULE,
                    KEY_SCOPE_ANY, KEY_SCOPE_TOKEN, KEY_SCOPES, KINDS, NAME_RULE, OUTPUTS, SHM_DIR, SYSTEM,
                    RegionExists, RegionNotFound, check_key, check_name, check_outputs, key_prefix, owner_of,
                    region_of)
from .region import RegionInfo, RegionLease
from .registry import RegionRegistry

__all__ = [
    "CUDA", "CUDA_IPC_HANDLE_BYTES", "DEFAULT_MAX_MAPPED_BYTES", "DEFAULT_MAX_REGIONS", "KEY_RULE", "KEY_SCOPE_ANY",
    "KEY_SCOPE_TOKEN", "KEY_SCOPES", "KINDS", "NAME_RULE", "OUTPUTS", "SHM_DIR", "SYSTEM", "CallRegions",
    "RegionExists", "RegionInfo", "RegionLease", "RegionNotFound", "RegionRegistry", "check_key", "check_name",
    "check_outputs", "key_prefix", "owner_of", "region_of",
]
