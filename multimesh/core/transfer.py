"""Moving a value onto another submesh, in one process or across several.

In one process every move is one `jax.device_put`. With several processes
(multi-controller JAX) every process calls `move` for every value, in the same
order, and each takes its part: JAX's cross-host transfer (the
``jax_cross_host_transfer_socket_address`` mechanism) only copies between
shardings with the *same shard indices* whose every shard changes process, and
only reshards in place across processes on the *same device set*. A move is
therefore planned from facts every process shares (the device sets and
their processes), as the first of these that applies:

1. both sides in one process: that process copies, the others hold a placeholder;
2. same device set: one `jax.device_put` (a reshard across processes);
3. equal device counts, every device paired with one on the same process:
   reshard in place onto the bridge sharding (the target's shard indices on
   the source devices), then each process copies its shards locally;
4. equal device counts, other sets of processes, every device paired with
   one on another process: reshard onto the bridge, then one cross-host
   transfer;
5. otherwise (device counts differ): the value is replicated on its devices,
   one full copy is sent to each process of the target, and each process cuts
   its own shards from it.

A placeholder is a `jax.Array` with the global shape and sharding but no
shards in this process (``jax.make_array_from_single_device_arrays`` with no
arrays): it stands for a value another process holds.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .._compat.jax import HAS_BATCHED_COPY, batched_copy

__all__ = ["everywhere", "move", "placeholder", "put", "reshard_to", "target_on"]


def target_on(x: Any, mesh: Mesh) -> NamedSharding:
    """``x``'s sharding on ``mesh``: its `PartitionSpec` where the mesh can hold it, else replicated."""
    sharding = getattr(x, "sharding", None)
    spec = sharding.spec if isinstance(sharding, NamedSharding) else PartitionSpec()
    return NamedSharding(mesh, spec if _fits(spec, mesh, np.shape(x)) else PartitionSpec())


def move(xs: Sequence[Any], targets: Sequence[NamedSharding]) -> list[jax.Array]:
    """Every ``xs[i]`` onto ``targets[i]`` (the runtime's only transfer).

    One process: one batched `jax.device_put`. Several: each value as planned
    above; every process must make the same calls in the same order.
    """
    if jax.process_count() == 1:
        if HAS_BATCHED_COPY and all(_shard_for_shard(x, t) for x, t in zip(xs, targets)):
            return batched_copy(xs, targets)
        return jax.device_put(list(xs), list(targets))
    return [put(x, t) for x, t in zip(xs, targets)]


# A pipeline moves small activations between submeshes many times a step, and almost always shard for
# shard: the same spec on a mesh of the same shape. For that case `jax.device_put` ends, after its
# Python checks (about 50 us a call on CPU), in one call of the runtime's batched copy; `move` makes that
# call itself. Where jaxlib lacks it, every move goes through `jax.device_put`.


def _shard_for_shard(x: Any, target: NamedSharding) -> bool:
    """Whether moving ``x`` onto ``target`` copies each shard whole to one device (what `jax.device_put`
    hands to the runtime's batched copy): a live, fully addressable array whose sharding has
    ``target``'s spec, mesh shape, axis names and memory kind. Not a typed PRNG key (``nnx.Rngs``'
    state): the batched copy takes plain arrays only, `jax.device_put` moves keys."""
    s = getattr(x, "sharding", None)
    return (isinstance(s, NamedSharding) and isinstance(target, NamedSharding) and s.spec == target.spec
            and not jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended)
            and s.mesh.shape_tuple == target.mesh.shape_tuple and s.memory_kind == target.memory_kind
            and not x.is_deleted() and x.is_fully_addressable and target.is_fully_addressable)


def reshard_to(x: Any, mesh: Mesh) -> jax.Array:
    """Move ``x`` onto ``mesh``, keeping its `PartitionSpec` where the mesh can hold it, else replicated."""
    return put(x, target_on(x, mesh))


def put(x: Any, target: NamedSharding) -> jax.Array:
    """``x`` (an array, or a host value equal on every process) on ``target``."""
    if not isinstance(x, jax.Array):
        if target.is_fully_addressable:
            return jax.device_put(x, target)
        host = np.asarray(x)  # every process holds the whole value: each places its own shards
        return jax.make_array_from_callback(host.shape, target, lambda idx: host[idx], dtype=host.dtype)
    if jax.process_count() == 1 or x.sharding == target:
        return jax.device_put(x, target)
    src, dst = x.sharding, target
    owners = _processes(src.device_set) | _processes(dst.device_set)
    if len(owners) == 1:
        return jax.device_put(x, dst) if jax.process_index() in owners else placeholder(x, dst)
    if src.device_set == dst.device_set:
        return _in_place(x, dst)
    if len(src.device_set) == len(dst.device_set):
        sources, targets = sorted(src.device_set, key=_id), list(dst.mesh.devices.flat)
        pairs = _pairing(sources, targets, across=False)
        if pairs is not None:
            return _local_copies(_in_place(x, _bridge(dst, pairs)), dst)
        # JAX transfers across hosts only between different sets of processes
        pairs = _pairing(sources, targets, across=True) if _processes(sources) != _processes(targets) else None
        if pairs is not None:
            return jax.device_put(_in_place(x, _bridge(dst, pairs)), dst)
    return _through_full_copies(x, dst)


def _in_place(x: jax.Array, dst: NamedSharding) -> jax.Array:
    """``x`` resharded onto ``dst``, on the same devices (spanning several processes)."""
    if x.sharding == dst:
        return x
    if isinstance(x.sharding, NamedSharding):
        return jax.device_put(x, dst)
    return _identity(dst)(x)  # JAX reshards in place across processes only from a NamedSharding


@functools.cache
def _identity(dst: NamedSharding) -> Any:
    return jax.jit(lambda a: a, out_shardings=dst)


def everywhere(x: jax.Array) -> NamedSharding:
    """A replicated sharding with one device in every process (the process's
    own device of ``x`` where it holds one): a value on it is readable everywhere."""
    held: set[jax.Device] = x.sharding.device_set  # the public type: the alias in jax's own hints is none to mypy
    mine = {d.process_index: d for d in sorted(held, key=_id, reverse=True)}
    first = {d.process_index: d for d in sorted(jax.devices(), key=_id, reverse=True)}
    devices = [mine.get(p, first[p]) for p in sorted(first)]
    return NamedSharding(Mesh(np.array(devices), ("processes",)), PartitionSpec())


def placeholder(like: Any, sharding: NamedSharding) -> jax.Array:
    """A value held by other processes: ``like``'s shape and dtype on ``sharding``, no shards here."""
    return jax.make_array_from_single_device_arrays(np.shape(like), sharding, [], dtype=like.dtype)


def _id(d: Any) -> int:
    return d.id


def _processes(devices: Any) -> set[int]:
    return {d.process_index for d in devices}


def _pairing(src: list, dst: list, *, across: bool) -> list | None:
    """A source device for each target device, all on other processes (``across``) or all on the
    same process; None when there is none. Greedy from the fullest process: enough for the
    regular layouts pipelines use."""
    free: dict[int, list] = {}
    for d in src:
        free.setdefault(d.process_index, []).append(d)
    pairs = []
    for d in dst:
        if across:
            options = [p for p in free if p != d.process_index and free[p]]
            if not options:
                return None
            p = max(options, key=lambda q: (len(free[q]), -q))
        else:
            p = d.process_index
            if not free.get(p):
                return None
        pairs.append(free[p].pop(0))
    return pairs


def _bridge(dst: NamedSharding, pairs: list) -> NamedSharding:
    """``dst``'s mesh shape and spec laid over the paired source devices: the same shard indices."""
    mesh = Mesh(np.array(pairs, dtype=object).reshape(dst.mesh.devices.shape), dst.mesh.axis_names)
    return NamedSharding(mesh, dst.spec)


def _local_copies(x: jax.Array, dst: NamedSharding) -> jax.Array:
    """``x`` (on the bridge of ``dst``: shard ``i`` in the process of ``dst``'s device ``i``) onto ``dst``, each
    process copying its own shards."""
    bridge = x.sharding
    if not isinstance(bridge, NamedSharding):
        raise TypeError(f"a local copy onto {dst} starts from an array on its bridge, a NamedSharding, not on {bridge}")
    position = {d: i for i, d in enumerate(bridge.mesh.devices.flat)}
    targets = list(dst.mesh.devices.flat)
    shards = [jax.device_put(s.data, targets[position[s.device]]) for s in x.addressable_shards]
    return jax.make_array_from_single_device_arrays(x.shape, dst, shards)


def _single(device: Any) -> NamedSharding:
    return NamedSharding(Mesh(np.array([device]), ("one",)), PartitionSpec())


def _through_full_copies(x: jax.Array, dst: NamedSharding) -> jax.Array:
    """The general move: replicate ``x`` on its devices, send one full copy to each of ``dst``'s
    processes, and let each cut its shards from its copy."""
    me = jax.process_index()
    held: set[jax.Device] = x.sharding.device_set  # as in everywhere()
    src_devices = sorted(held, key=_id)
    replicated = put(x, NamedSharding(Mesh(np.array(src_devices), ("all",)), PartitionSpec()))
    holder = {d.process_index: d for d in reversed(src_devices)}  # first source device of each process
    sender = src_devices[0]
    full = None
    dst_devices: set[jax.Device] = dst.device_set
    for p in sorted(_processes(dst_devices)):
        if p in holder:
            if p == me:
                full = replicated.addressable_data(0)
            continue
        receiver = min((d for d in dst_devices if d.process_index == p), key=_id)
        if me == sender.process_index:
            source = jax.device_put(replicated.addressable_data(0), _single(sender))
        else:
            source = placeholder(x, _single(sender))
        copy = jax.device_put(source, _single(receiver))  # every process calls it: same order everywhere
        if p == me:
            full = copy.addressable_data(0)
    if full is None:
        return placeholder(x, dst)
    shards = [jax.device_put(full[index], d) for d, index in dst.addressable_devices_indices_map(x.shape).items()]
    return jax.make_array_from_single_device_arrays(x.shape, dst, shards)


def _fits(spec: PartitionSpec, mesh: Mesh, shape: Sequence[int]) -> bool:
    sizes = dict(mesh.shape)
    for d, entry in enumerate(spec):
        if entry is None:
            continue
        axes = (entry,) if isinstance(entry, str) else tuple(entry)
        if any(a not in sizes for a in axes) or shape[d] % math.prod(sizes[a] for a in axes):
            return False
    return True
