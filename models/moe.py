"""A Mixture-of-Experts feed-forward layer (Flax Linen and NNX), with expert and expert tensor parallelism.

Each token is sent to ``k`` of ``E`` SwiGLU experts (Mixtral / Qwen3-MoE routing):

1. **Route.** A float32 router gives each token a softmax over the experts; it picks the top ``k``
   and renormalises their probabilities into gates that sum to 1 (:func:`route`).
2. **Balance.** The load-balancing loss (Switch Transformer / GShard) is
   ``E * sum_e f_e * P_e``: ``f_e`` the share of the assignments that went to expert ``e``,
   ``P_e`` its mean router probability, computed per sequence and averaged over the batch
   (:func:`load_balancing_loss`). It is 1 when the load is even.
   The layer sows it (``intermediates`` / ``nnx.Intermediate``, name ``moe_aux_loss``); the
   trainer adds ``moe_aux_loss_coef`` times its sum over layers to the loss (:func:`sown_aux_loss`).
3. **Compute.** The token copies are sorted by expert and every expert's rows go through one
   grouped product, ``jax.lax.ragged_dot`` with the experts' group sizes (:func:`experts_local`);
   the results are put back in token order and summed with the gates.

Expert parallelism: on a mesh with an ``expert`` axis of size ``n > 1`` (:data:`EXPERT_AXIS`), each
device holds ``E / n`` experts (the logical axis ``expert`` of the weights, which the rules map to the
mesh axis ``expert``) and its own tokens (the batch is split over ``expert`` too, as over ``data``).
Inside a ``shard_map`` (``multimesh.jax.shard_map`` without a mesh: the mesh in scope, a pipeline
stage's submesh in a stage) every device sorts its token copies by destination, sends them with
``jax.lax.all_to_all`` to the devices that own their experts, computes them there with
``ragged_dot`` and sends the results back (:func:`experts_all_to_all`). The copies travel in the
compute dtype (``model.dtype``), and so do the experts' outputs. Without an ``expert`` axis (or of size
1, or on one device) every expert is computed locally, with no all-to-all.

Expert tensor parallelism (Megatron's "expert tensor parallel"): where the rules map the experts' hidden
axis ``mlp`` (:data:`HIDDEN_AXIS`) to mesh axes of size ``t > 1`` (``tensor`` under ``standard_rules``),
each device holds ``F / t`` of the hidden units of every one of its experts, and the ``shard_map``'s weight
specs split ``F`` over them. The tokens are the same on every device of those axes (the batch's, which the
rules do not split there); each device computes its share of the SwiGLU hidden units for the copies its
experts receive, and the partial outputs are summed over the axes with ``jax.lax.psum`` in the compute
dtype, after the return all-to-all and the gates' combine: there a device holds its ``N`` tokens x ``D``,
where the results sent back are ``n`` x ``S`` slots x ``D`` (``S >= N * k`` dropless). No device gathers
an expert's weights whole. Without an ``expert`` axis the same ``shard_map`` runs :func:`experts_local` on
each device's tokens. ``F`` must be a multiple of ``t`` (a ValueError names ``d_ff``, the axis, the sizes
and the fix). The layer finds the axes with ``multimesh.jax.resolve_in_scope``, as its ``shard_map``
resolves its logical specs (a pipeline stage's rules inside the stage).

Capacity (``model.moe_capacity_factor``, ``c``; GShard / Switch Transformer / MaxText). Unset (the
default), no copy is dropped: each device's send buffer holds, for every destination, as many rows as
it has token copies (the worst case: all of them routed to one device's experts), so the result is the
one-device result exactly, at ``n`` times the rows a balanced load needs, in the all-to-alls and in the
grouped products. With ``c``, each expert takes at most ``C = min(ceil(c * N * k / E), N)`` copies from
each group of ``N`` tokens: the tokens one device sends (:func:`expert_capacity`), the ``N`` of the
whole call where the mesh has neither an expert nor a tensor axis. The group is the source device's
tokens because that is what a device can count without a collective, and so what sizes its send
buffer: ``E / n`` experts x ``C`` slots per destination, ``c`` times the rows of a balanced load; the
receiving device computes ``n`` x ``E / n`` x ``C`` rows. Copies are ranked in token order within
their expert (earlier tokens first, as Megatron's "position" drop policy); those ranked ``C`` or later
are dropped: their expert output is zero and the gates are not renormalised, so the token keeps what
its other experts and the residual connection give it. ``c >= E / k`` never drops (``C = N``); ``c = 1``
is exactly the balanced load.

Parameters of one layer (``E = num_experts``, ``F = d_ff``)::

    router  [embed, E]     ('embed', None)
    wi_0    [E, embed, F]  ('expert', 'embed', 'mlp')   (gate)
    wi_1    [E, embed, F]  ('expert', 'embed', 'mlp')   (up)
    wo      [E, F, embed]  ('expert', 'mlp', 'embed')
"""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from multimesh.jax import mesh_in_scope, resolve_in_scope, shard_map

from .config import TransformerConfig

__all__ = [
    "AUX_LOSS_NAME",
    "EXPERT_AXIS",
    "HIDDEN_AXIS",
    "MoeBlock",
    "NnxMoeBlock",
    "experts_all_to_all",
    "expert_capacity",
    "experts_local",
    "load_balancing_loss",
    "moe_ffn",
    "route",
    "sown_aux_loss",
]

Array = jax.Array

#: The logical axis of the experts' weights, and the mesh axis that expert parallelism runs over.
EXPERT_AXIS = "expert"
#: The name under which each MoE layer sows its load-balancing loss.
AUX_LOSS_NAME = "moe_aux_loss"

#: The logical axis of the experts' hidden units (``d_ff``), which expert tensor parallelism splits.
HIDDEN_AXIS = "mlp"

ROUTER_AXES = ("embed", None)
WI_AXES = (EXPERT_AXIS, "embed", HIDDEN_AXIS)
WO_AXES = (EXPERT_AXIS, HIDDEN_AXIS, "embed")


def _expert_kernel_init() -> nn.initializers.Initializer:
    # [E, fan_in, fan_out]: each expert initialised as a dense layer of its own
    return nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=-2, out_axis=-1,
                                            batch_axis=(0,))


def _router_init() -> nn.initializers.Initializer:
    return nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal")


# -- routing ------------------------------------------------------------------------------------------------


def route(x: Array, router: Array, k: int) -> tuple[Array, Array, Array]:
    """``(expert_ids [..., k] int32, gates [..., k] float32, probs [..., E] float32)`` of tokens ``x`` [..., embed].

    The router runs in float32; ``gates`` are the top-``k`` probabilities renormalised to sum to 1.
    """
    logits = jnp.einsum("...d,de->...e", x.astype(jnp.float32), router.astype(jnp.float32))
    probs = jax.nn.softmax(logits, axis=-1)
    top, ids = jax.lax.top_k(probs, k)
    gates = top / jnp.sum(top, axis=-1, keepdims=True)
    return ids.astype(jnp.int32), gates, probs


def load_balancing_loss(probs: Array, expert_ids: Array) -> Array:
    """``E * sum_e f_e * P_e`` of each sequence, averaged over the sequences.

    ``probs`` [..., T, E] and ``expert_ids`` [..., T, k]: the router probabilities and choices of the
    ``T`` tokens of each sequence (any leading axes: the batch). ``f_e``: the share of a sequence's
    token-to-expert assignments that chose ``e`` (the ``f`` sum to 1); ``P_e``: its mean router
    probability of ``e``. An even load gives 1. Per sequence (the balance DeepSeek-V3's sequence-wise
    loss asks for; one sequence: the Switch Transformer's formula), a batch's loss is the mean of its
    sequences', so it does not depend on how the batch is split into microbatches or over devices.
    """
    e, tokens, k = probs.shape[-1], probs.shape[-2], expert_ids.shape[-1]
    counts = jnp.sum(jax.nn.one_hot(expert_ids, e, dtype=jnp.float32), axis=(-3, -2))  # [..., E]
    f = counts / (tokens * k)
    mean_probs = jnp.mean(probs, axis=-2)
    return jnp.mean(e * jnp.sum(f * mean_probs, axis=-1))


# -- the experts ----------------------------------------------------------------------------------------------


def _swiglu_grouped(rows: Array, group_sizes: Array, wi_0: Array, wi_1: Array, wo: Array) -> Array:
    """``wo(silu(wi_0 x) * wi_1 x)`` of rows sorted by expert, ``group_sizes[e]`` rows for expert ``e``.

    Rows past ``sum(group_sizes)`` (padding) come out as zeros. Computes in the weights' dtype,
    accumulates in float32.
    """
    dt = wi_0.dtype
    rows = rows.astype(dt)
    gate = jax.lax.ragged_dot(rows, wi_0, group_sizes, preferred_element_type=jnp.float32)
    up = jax.lax.ragged_dot(rows, wi_1, group_sizes, preferred_element_type=jnp.float32)
    hidden = (jax.nn.silu(gate) * up).astype(dt)
    return jax.lax.ragged_dot(hidden, wo, group_sizes, preferred_element_type=jnp.float32)


def _group_sizes(ids: Array, groups: int) -> Array:
    """How many of ``ids`` equal each of ``0 .. groups-1`` (others, the padding, are not counted)."""
    return jnp.sum(ids[:, None] == jnp.arange(groups, dtype=ids.dtype)[None, :], axis=0, dtype=jnp.int32)


def _combine(per_copy: Array, gates: Array) -> Array:
    """Each token's ``k`` expert outputs [N * k, D] weighted by its ``gates`` [N, k] and summed: [N, D]."""
    n, k = gates.shape
    return jnp.einsum("nkd,nk->nd", per_copy.reshape(n, k, -1), gates)


def expert_capacity(tokens: int, k: int, experts: int, capacity_factor: float | None) -> int | None:
    """The copies each expert takes from a group of ``tokens`` tokens, each sent to ``k`` of ``experts``
    experts: ``min(ceil(capacity_factor * tokens * k / experts), tokens)`` (None: no capacity, dropless)."""
    if capacity_factor is None:
        return None
    return min(math.ceil(capacity_factor * tokens * k / experts), tokens)


def _ranks(sorted_ids: Array, groups: int) -> Array:
    """Each of ``sorted_ids`` (sorted, stably) its place among the equal ones before it: 0, 1, ... per id."""
    counts = _group_sizes(sorted_ids, groups)
    return jnp.arange(sorted_ids.shape[0]) - (jnp.cumsum(counts) - counts)[sorted_ids]


def experts_local(x: Array, expert_ids: Array, gates: Array, wi_0: Array, wi_1: Array, wo: Array,
                  capacity: int | None = None) -> Array:
    """Every expert on this device: tokens ``x`` [N, D], their ``expert_ids``/``gates`` [N, k] -> float32 [N, D].

    The ``N * k`` token copies are sorted by expert (stably), computed by one grouped product per
    weight (in ``x``'s dtype), put back in token order and combined with the gates. ``capacity``: each
    expert takes its first ``capacity`` copies in token order and drops the rest (their output is 0); the
    grouped products then run over ``min(N * k, E * capacity)`` rows.
    """
    k, e = expert_ids.shape[-1], wi_0.shape[0]
    flat = expert_ids.reshape(-1)
    if capacity is not None:  # dropped copies sort last, past every group
        order = jnp.argsort(flat, stable=True)
        dropped = jnp.zeros_like(flat, bool).at[order].set(_ranks(flat[order], e) >= capacity)
        flat = jnp.where(dropped, e, flat)
    order = jnp.argsort(flat, stable=True)
    rows = order if capacity is None else order[:min(flat.shape[0], e * capacity)]
    out = _swiglu_grouped(x[rows // k], _group_sizes(flat, e), wi_0, wi_1, wo).astype(x.dtype)
    per_copy = jnp.zeros((flat.shape[0], out.shape[-1]), out.dtype).at[rows].set(out)
    return _combine(per_copy, gates)


def experts_all_to_all(x: Array, expert_ids: Array, gates: Array, wi_0: Array, wi_1: Array, wo: Array,
                       axis: str = EXPERT_AXIS, capacity: int | None = None) -> Array:
    """The body of the expert-parallel ``shard_map``: this device's tokens ``x`` [N, D] with their
    ``expert_ids``/``gates`` [N, k] (global expert ids), and its ``E / n`` experts' weights; the ``n``
    devices of mesh axis ``axis`` hold the experts in order. Returns this device's float32 outputs [N, D].

    Copies go to their expert's device in one ``all_to_all`` of ``[n, S, D]`` in ``x``'s dtype, are
    computed there in expert order, and come back in another. ``capacity`` None: ``S = N * k``, a slot
    per copy for every destination (dropless); else ``S = E / n * capacity``, ``capacity`` slots per
    expert, and the copies each expert ranks ``capacity`` or later (in token order) are dropped.
    Given a share of the experts' hidden units (``F / t`` columns of ``wi_0``/``wi_1``, rows of ``wo``), the
    result is that share's partial output: :func:`moe_ffn` sums it over the tensor axes.
    """
    n_dev = jax.lax.axis_size(axis)
    local = wi_0.shape[0]
    k = expert_ids.shape[-1]
    copies = expert_ids.size
    flat = expert_ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # by expert, hence by destination device
    sorted_ids = flat[order]
    dest = sorted_ids // local
    if capacity is None:
        width, slot = copies, _ranks(dest, n_dev)  # the copy's place among its destination's
    else:  # the copy's place among its expert's, in that expert's block of slots; past the buffer: dropped
        rank = _ranks(sorted_ids, n_dev * local)
        width = local * capacity
        slot = jnp.where(rank < capacity, (sorted_ids % local) * capacity + rank, width)
    send = jnp.zeros((n_dev, width, x.shape[-1]), x.dtype).at[dest, slot].set(x[order // k], mode="drop")
    send_ids = jnp.full((n_dev, width), local, jnp.int32).at[dest, slot].set(sorted_ids % local, mode="drop")
    recv = jax.lax.all_to_all(send, axis, 0, 0)  # recv[j]: what device j sent here
    recv_ids = jax.lax.all_to_all(send_ids, axis, 0, 0).reshape(-1)  # local: an empty slot
    by_expert = jnp.argsort(recv_ids, stable=True)  # empty slots (id == local) last
    out = _swiglu_grouped(recv.reshape(-1, x.shape[-1])[by_expert], _group_sizes(recv_ids, local), wi_0, wi_1, wo)
    done = jnp.zeros_like(out, x.dtype).at[by_expert].set(out.astype(x.dtype)).reshape(n_dev, width, -1)
    back = jax.lax.all_to_all(done, axis, 0, 0)  # back[j]: what device j computed for the copies sent to it
    returned = back.at[dest, slot].get(mode="fill", fill_value=0)  # a dropped copy: 0
    per_copy = jnp.zeros((copies, out.shape[-1]), x.dtype).at[order].set(returned)
    return _combine(per_copy, gates)


def _mesh_axes(logical: str | tuple[str, ...], sizes: dict[str, int]) -> tuple[str, ...]:
    """The mesh axes of size > 1 that the rules in force give the logical name(s) ``logical``."""
    entry = resolve_in_scope(P(logical))[0]
    names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
    return tuple(a for a in names if sizes.get(a, 1) > 1)


def _check_split(e: int, n: int, f: int, tensor: tuple[str, ...], t: int, token_axes: tuple[str, ...]) -> None:
    """The experts over ``n`` expert devices and their ``f`` hidden units over ``t`` tensor devices, or a
    ValueError naming the sizes and the fix."""
    if e % n:
        raise ValueError(f"num_experts={e} is not divisible by the mesh's {EXPERT_AXIS!r} axis of size {n}: each "
                         f"device must hold the same number of experts; make the {EXPERT_AXIS!r} axis a divisor "
                         f"of {e}, or num_experts a multiple of {n}")
    axes = ", ".join(map(repr, tensor))
    if f % t:
        raise ValueError(f"d_ff={f} is not divisible by the mesh axis {axes} of size {t} that the rules map the "
                         f"experts' hidden axis {HIDDEN_AXIS!r} to: each device of it computes d_ff / {t} of every "
                         f"expert's hidden units; make d_ff a multiple of {t}, or that axis a divisor of {f}")
    if set(tensor) & set(token_axes):
        raise ValueError(f"the rules map the experts' hidden axis {HIDDEN_AXIS!r} to the mesh axis {axes}, which "
                         f"also splits the tokens (over {token_axes}): a device would sum partial outputs of other "
                         f"devices' tokens; map {HIDDEN_AXIS!r} to an axis the batch is not split over "
                         f"(standard_rules maps it to 'tensor')")


def _varying(x: Array, axes: tuple[str, ...]) -> Array:
    """``x`` (the same on every device of ``axes``) marked as varying over them, with no communication: its
    gradient, a partial sum on each device, is then summed over ``axes`` once, at ``x``'s size, instead of
    wherever ``x`` first meets a weight split over them (the token copies, ``k`` to ``n * k`` times larger)."""
    return jax.lax.pcast(x, axes, to="varying") if axes else x


def _summed(partial: Array, axes: tuple[str, ...], dtype: Any) -> Array:
    """The sum over ``axes`` of each device's partial output ``partial`` [N, D] (its share of the hidden units),
    sent in the compute ``dtype``; float32 as the layer returns it."""
    if not axes:
        return partial
    return jax.lax.psum(partial.astype(dtype), axes).astype(jnp.float32)


def moe_ffn(x: Array, expert_ids: Array, gates: Array, wi_0: Array, wi_1: Array, wo: Array,
            capacity_factor: float | None = None) -> Array:
    """The experts' gate-weighted output for tokens ``x`` [..., D] (float32 [..., D]).

    With an ``expert`` axis of size ``n > 1`` in the mesh in scope, by :func:`experts_all_to_all`
    inside a ``shard_map`` (tokens split like the batch, experts over ``expert``); else
    :func:`experts_local`. Where the rules map ``mlp`` to mesh axes of size ``t > 1`` the experts are
    tensor-parallel too: each device computes ``d_ff / t`` of its experts' hidden units and the partial
    outputs are summed over those axes. ``capacity_factor``: each expert's capacity per group of tokens
    (:func:`expert_capacity`; None: dropless).
    """
    lead, d = x.shape[:-1], x.shape[-1]
    k = expert_ids.shape[-1]
    tokens, ids, g = x.reshape(-1, d), expert_ids.reshape(-1, k), gates.reshape(-1, k)
    mesh = mesh_in_scope()
    sizes = {} if mesh is None else {str(a): int(s) for a, s in dict(mesh.shape).items()}
    n = sizes.get(EXPERT_AXIS, 1)
    tensor = _mesh_axes(HIDDEN_AXIS, sizes)
    t = math.prod(sizes[a] for a in tensor)
    e, f = wi_0.shape[0], wi_0.shape[-1]
    if n == 1 and t == 1:
        capacity = expert_capacity(tokens.shape[0], k, e, capacity_factor)
        return experts_local(tokens, ids, g, wi_0, wi_1, wo, capacity).reshape(*lead, d)
    _check_split(e, n, f, tensor, t, _mesh_axes(("batch", EXPERT_AXIS), sizes))

    def body(xs: Array, i: Array, gg: Array, w0: Array, w1: Array, w2: Array) -> Array:
        if w0.shape[0] * n != e:
            raise ValueError(f"the experts' weights are split {e // w0.shape[0]} ways, not over the mesh axis "
                             f"{EXPERT_AXIS!r} of size {n}: map the logical axis {EXPERT_AXIS!r} to the mesh axis "
                             f"{EXPERT_AXIS!r} in the rules (standard_rules does)")
        capacity = expert_capacity(xs.shape[0], k, e, capacity_factor)  # per source device: its own tokens
        xs = _varying(xs, tensor)
        if n == 1:
            partial = experts_local(xs, i, gg, w0, w1, w2, capacity)
        else:
            partial = experts_all_to_all(xs, i, gg, w0, w1, w2, capacity=capacity)
        # Summed after the return all-to-all and the gates' combine: [N, D] per device, where the results
        # sent back are n x S x D (S >= N * k dropless, E / n x capacity slots with a capacity factor)
        return _summed(partial, tensor, xs.dtype)

    # tokens split like the batch, and over the expert axis where the rules leave the batch whole there;
    # the same on every device of the tensor axes, each of which holds its share of the experts' hidden units
    rows = P(("batch", EXPERT_AXIS), None)
    split_wi, split_wo = P(EXPERT_AXIS, None, HIDDEN_AXIS), P(EXPERT_AXIS, HIDDEN_AXIS, None)
    y = shard_map(body, in_specs=(rows, rows, rows, split_wi, split_wi, split_wo), out_specs=rows)(
        tokens, ids, g, wi_0, wi_1, wo)
    return y.reshape(*lead, d)


def sown_aux_loss(intermediates: Any) -> Array:
    """The sum of every ``moe_aux_loss`` sown in ``intermediates`` (Linen's collection or NNX's
    ``nnx.Intermediate`` state as a pure dict); 0.0 when the model has no MoE layer."""
    total = jnp.zeros((), jnp.float32)
    for path, leaf in jax.tree_util.tree_leaves_with_path(intermediates):
        if any(str(getattr(key, "key", "")) == AUX_LOSS_NAME for key in path):
            total = total + jnp.asarray(leaf, jnp.float32)
    return total


def _check_top_k(config: TransformerConfig) -> None:
    if not 1 <= config.experts_per_token <= config.num_experts:
        raise ValueError(f"experts_per_token={config.experts_per_token} must be between 1 and "
                         f"num_experts={config.num_experts}")


def _forward(config: TransformerConfig, x: Array, router: Array, wi_0: Array, wi_1: Array,
             wo: Array) -> tuple[Array, Array]:
    """The layer's output (compute dtype) and its load-balancing loss."""
    dt = config.compute_dtype
    ids, gates, probs = route(x, router, config.experts_per_token)
    y = moe_ffn(x.astype(dt), ids, gates, wi_0.astype(dt), wi_1.astype(dt), wo.astype(dt),
                config.moe_capacity_factor)
    return y.astype(dt), load_balancing_loss(probs, ids)


class MoeBlock(nn.Module):
    """Linen MoE feed-forward, the drop-in for ``MlpBlock`` when ``config.num_experts > 0``.

    ``x`` [batch, length, embed] -> [batch, length, embed]; sows its load-balancing loss as
    ``intermediates/.../moe_aux_loss``.
    """

    config: TransformerConfig

    @nn.compact
    def __call__(self, x: Array) -> Array:
        cfg = self.config
        _check_top_k(cfg)
        e, d, f = cfg.num_experts, cfg.d_model, cfg.d_ff
        pd = cfg.params_dtype

        def param(name: str, init: Any, axes: tuple, shape: tuple) -> Array:  # the array: Linen unboxes it
            return self.param(name, nn.with_logical_partitioning(init, axes), shape, pd)  # type: ignore[return-value]

        router = param("router", _router_init(), ROUTER_AXES, (d, e))
        wi_0 = param("wi_0", _expert_kernel_init(), WI_AXES, (e, d, f))
        wi_1 = param("wi_1", _expert_kernel_init(), WI_AXES, (e, d, f))
        wo = param("wo", _expert_kernel_init(), WO_AXES, (e, f, d))
        y, aux = _forward(cfg, x, router, wi_0, wi_1, wo)
        self.sow("intermediates", AUX_LOSS_NAME, aux)
        return y


class NnxMoeBlock(nnx.Module):
    """The NNX twin of :class:`MoeBlock` (same parameters, names and logical axes); sows its
    load-balancing loss as an ``nnx.Intermediate`` named ``moe_aux_loss`` (inside ``nnx.capture``
    where Flax has it)."""

    def __init__(self, cfg: TransformerConfig, rngs: nnx.Rngs):
        _check_top_k(cfg)
        self.config = cfg
        e, d, f = cfg.num_experts, cfg.d_model, cfg.d_ff
        pd = cfg.params_dtype

        def param(init: Any, axes: tuple, shape: tuple) -> nnx.Param:
            return nnx.Param(nnx.with_partitioning(init, axes)(rngs.params(), shape, pd))

        self.router = param(_router_init(), ROUTER_AXES, (d, e))
        self.wi_0 = param(_expert_kernel_init(), WI_AXES, (e, d, f))
        self.wi_1 = param(_expert_kernel_init(), WI_AXES, (e, d, f))
        self.wo = param(_expert_kernel_init(), WO_AXES, (e, f, d))

    def __call__(self, x: Array) -> Array:
        y, aux = _forward(self.config, x, self.router[...], self.wi_0[...], self.wi_1[...], self.wo[...])
        if hasattr(nnx, "capture"):  # Flax's new form: recorded inside nnx.capture only, else nothing is kept
            self.sow(nnx.Intermediate, AUX_LOSS_NAME, aux, capture_noop=True)
        else:
            self.sow(nnx.Intermediate, AUX_LOSS_NAME, aux)
        return y
