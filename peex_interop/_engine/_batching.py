"""Making a value per example along every `jax.vmap` it runs in.

A layer called in a `vmap` body on inputs that do not vary over the batch (closed over,
or passed with `in_axes=None`) computes its output once: the value is *unbatched*
there, and JAX transposes the implicit broadcast of its later uses into a sum over the
examples, so the cotangent that reaches the layer's output is the sum of every example's.
A `BackwardHook`'s slot there is per example (it comes in mapped): so that it receives
each example's own cotangent, the value it hooks must be batched too.

`per_example(value)` binds `peex_interop_per_example`, an identity whose batching rule is
called at every enclosing vmap even when its input is unbatched there (a rule given to
`_jax.register_batching` is always called), and broadcasts it along that vmap's axis
(exact: every row is the value). It then binds itself again one trace
further out, so nested vmaps, and the vmaps a jit's program is batched by later (a jit
inside a vmap body), all see it. Outside any vmap it is the identity in every
interpretation: evaluation, lowering, differentiation (linear, its own transpose).
"""

from typing import Any

import equinox as eqx
import jax.numpy as jnp
import jax.tree_util as jtu

from . import _jax

per_example_p = _jax.Primitive("peex_interop_per_example")
per_example_p.def_impl(lambda x: x)
per_example_p.def_abstract_eval(lambda aval: aval)
_jax.register_lowering(per_example_p, lambda ctx, x: [x])
# Linear: the tangent is bound too (it is batched like the primal), and an identity
# is its own transpose.
_jax.register_linear(per_example_p, lambda cotangent, x: [cotangent])


def _per_example_batched(axis_data, values, dims):
    (value,), (dim,) = values, dims
    if dim is None:
        value, dim = jnp.broadcast_to(value, (axis_data.size, *jnp.shape(value))), 0
    # Bound at the trace around this vmap (the rule runs there): an enclosing vmap
    # broadcasts it along its own axis in turn.
    return per_example_p.bind(value), dim


_jax.register_batching(per_example_p, _per_example_batched)


def per_example(tree: Any) -> Any:
    """`tree` with every floating-point array batched along every enclosing `vmap`
    (unchanged values: one identical row per example where it was unbatched).

    **Arguments:**

    - `tree`: a pytree; leaves other than floating-point arrays (which have no
        cotangent) are returned as they are.

    **Returns:**

    A pytree of the same structure, shapes and dtypes (as seen in the vmap bodies).
    """
    return jtu.tree_map(lambda x: per_example_p.bind(x) if eqx.is_inexact_array(x) else x, tree)
