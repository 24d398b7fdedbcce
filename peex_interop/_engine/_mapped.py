"""The mapped transforms: `jax.vmap`, `jax.lax.scan`, `jax.lax.map`, a static-bound
`jax.lax.fori_loop` and `jax.shard_map`. A log of a layer inside their body leaves it
stacked along the mapped (scanned) axis, one block per device for `shard_map`; its
backward slots come in mapped, so cotangents are per example, step or device.
"""

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.core
import jax.numpy as jnp
import jax.tree_util as jtu

from . import _context, _patching, _pooling, _unthreaded
from ._bodies import Body


def _engine_axis_name() -> str:
    """An axis name for a vmap the user left unnamed: one per nesting depth of the
    named vmaps being traced, so that nested ones differ and each call of the model
    gets the same names (a fresh name would recompile every collective and retrace
    every jit inside, eager or not)."""
    return f"peex_interop_vmap_{len(_pooling.mapped_axes())}"


def _mapped_size(in_axes: Any, args: tuple, kwargs: dict, axis_size: int | None) -> int:
    """The size of a vmap's mapped axis, as JAX reads it from the arguments."""
    if axis_size is not None:
        return axis_size
    sizes = []

    def visit(axis: Any, tree: Any) -> None:
        if axis is not None:
            # A leaf without that axis is for the real vmap to refuse, in its own words.
            sizes.extend(
                jnp.shape(leaf)[axis] for leaf in jtu.tree_leaves(tree) if -jnp.ndim(leaf) <= axis < jnp.ndim(leaf)
            )

    per_arg = in_axes if isinstance(in_axes, (tuple, list)) else [in_axes] * len(args)
    for axis, arg in zip(per_arg, args):
        jtu.tree_map(visit, axis, arg, is_leaf=lambda x: x is None)
    for arg in kwargs.values():
        visit(0, arg)
    return sizes[0] if sizes else 0


def _with_leading_axis(in_axes: Any, num_args: int) -> Any:
    if isinstance(in_axes, (tuple, list)):
        return (0, *in_axes)
    return (0, *([in_axes] * num_args))


def threaded_vmap(real_vmap: Callable) -> Callable:
    def vmap(*vmap_args, **vmap_kwargs):
        options = _patching.bound_arguments(real_vmap, vmap_args, vmap_kwargs)
        fun = options.pop("fun")
        in_axes = options.pop("in_axes", 0)
        out_axes = options.pop("out_axes", 0)

        def mapped(*args, **kwargs):
            # An in_axes tuple not one per positional argument is JAX's to refuse, in its
            # own words (which differ by release), not about the engine's extra argument.
            mismatched = isinstance(in_axes, (tuple, list)) and len(in_axes) != len(args)
            if not _context.active() or mismatched:
                return real_vmap(fun, in_axes, out_axes, **options)(*args, **kwargs)
            body = Body(fun, (args, kwargs))
            length = _mapped_size(in_axes, args, kwargs, options.get("axis_size"))
            named = options
            if body.needs_names:
                # The index is read through an axis name (the user's, or one of ours).
                # Only then: a new axis name makes JAX retrace every jit inside.
                named = {**options, "axis_name": options.get("axis_name") or _engine_axis_name()}

            def run(probes):
                def mapped_body(probes, *inner_args, **inner_kwargs):
                    name = named.get("axis_name")
                    index = jax.lax.axis_index(name) if body.needs_indices else None
                    return body(probes, (inner_args, inner_kwargs), inner_args, inner_kwargs, index, length)

                axes = _with_leading_axis(in_axes, len(args))
                return _pooling.pooled_vmap(real_vmap, body)(mapped_body, axes, (out_axes, 0), **named)(
                    probes, *args, **kwargs
                )

            return body.run_mapped(run, lambda result: result[1], length)[0]

        return mapped

    return vmap


def threaded_scan(real_scan: Callable) -> Callable:
    def scan(*scan_args, **scan_kwargs):
        if not _context.active():
            return real_scan(*scan_args, **scan_kwargs)
        options = _patching.bound_arguments(real_scan, scan_args, scan_kwargs)
        f, init, xs = options.pop("f"), options.pop("init"), options.pop("xs", None)
        body = Body(f, (init, xs))
        length = options.get("length")
        if length is None:
            leaves = jtu.tree_leaves(xs)
            if not leaves:
                return real_scan(*scan_args, **scan_kwargs)  # JAX's own error: no length
            length = leaves[0].shape[0]
        steps = jnp.arange(length, dtype=jnp.int32) if body.needs_indices else None

        def run(probes):
            def scan_body(carry, x_probes_step):
                x, step_probes, step = x_probes_step
                (carry, y), logs = body(step_probes, (carry, x), (carry, x), {}, step, length)
                return carry, (y, logs)

            return real_scan(scan_body, init, (xs, probes, steps), **options)

        carry, (ys, _) = body.run_mapped(run, lambda result: result[1][1], length)
        return carry, ys

    return scan


def threaded_map(real_map: Callable) -> Callable:
    def map(*map_args, **map_kwargs):
        options = _patching.bound_arguments(real_map, map_args, map_kwargs)
        if not _context.active():
            return real_map(*map_args, **map_kwargs)
        if options.get("batch_size") is not None:
            # JAX's own scan-of-vmap plus a remainder: logs would be laid out by
            # batches, not per element; layers inside are refused.
            with _unthreaded.refusing("jax.lax.map with batch_size"):
                return real_map(*map_args, **map_kwargs)
        f = options["f"]
        # JAX's own definition of map without batch_size; logs stack per element.
        _, ys = jax.lax.scan(lambda carry, x: (carry, f(x)), (), options["xs"])
        return ys

    return map


def threaded_fori_loop(real_fori_loop: Callable) -> Callable:
    def fori_loop(*loop_args, **loop_kwargs):
        options = _patching.bound_arguments(real_fori_loop, loop_args, loop_kwargs)
        lower, upper = options["lower"], options["upper"]
        if not _context.active() or any(isinstance(b, jax.core.Tracer) for b in (lower, upper)):
            # Dynamic bounds make a while_loop, whose logs cannot leave: refused.
            return real_fori_loop(*loop_args, **loop_kwargs)
        body_fun, unroll = options["body_fun"], options.get("unroll")

        # JAX's own lowering of a static-bound fori_loop; logs stack per step.
        def scanned(carry, _):
            i, x = carry
            return (i + 1, body_fun(i, x)), None

        (_, result), _ = jax.lax.scan(
            scanned, (int(lower), options["init_val"]), None,
            length=max(int(upper) - int(lower), 0),
            unroll=False if unroll is None else unroll,
        )
        return result

    return fori_loop


def threaded_shard_map(real_shard_map: Callable) -> Callable:
    """Logs leave a `shard_map` body one block per device: a leading axis over the
    body's manual mesh axes (`(num_devices, *local_shape)`); backward slots come in
    the same way, so cotangents are per device."""

    def shard_map(*shard_args, **shard_kwargs):
        options = _patching.bound_arguments(real_shard_map, shard_args, shard_kwargs)
        f = options.pop("f", None)
        if f is None:
            return functools.partial(shard_map, **options)  # used as a decorator factory

        def sharded(*args):
            if not _context.active() or options.get("_smap"):
                return real_shard_map(f, **options)(*args)
            mesh = options.get("mesh") or jax.sharding.get_abstract_mesh()
            per_device = jax.sharding.PartitionSpec(tuple(options.get("axis_names") or mesh.axis_names))
            in_specs = options.get("in_specs", _patching.signature(real_shard_map).parameters["in_specs"].default)
            if not isinstance(in_specs, tuple):
                in_specs = (in_specs,) * len(args)
            body = Body(f, args)

            def run(probes):
                def sharded_body(probes, *inner):
                    local = jtu.tree_map(lambda slot: slot[0], probes)
                    out, logs = body(local, inner, inner, {})
                    return out, jtu.tree_map(lambda log: log[None], logs)

                if isinstance(mesh, jax.sharding.Mesh):
                    # Eager inputs must already be laid out as their in_specs say.
                    probes = jax.device_put(probes, jax.sharding.NamedSharding(mesh, per_device))
                return real_shard_map(
                    sharded_body,
                    **{**options, "in_specs": (per_device, *in_specs), "out_specs": (options["out_specs"], per_device)},
                )(probes, *args)

            # Not a stack: no slot of one step to spread over the devices.
            return body.run_mapped(run, lambda result: result[1], None)[0]

        return sharded

    return shard_map
