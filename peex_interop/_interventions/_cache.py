"""`px.cache`: one forward pass that returns the output and the value of every site
(TransformerLens's `run_with_cache`, which caches every hook point), or of the selected
ones: the input of `px.patch` and `px.MeanAblation`."""

from typing import Any

import equinox as eqx
from jaxtyping import PyTree

from .._engine import EVERY_SITE, Where
from .._hooks import ForwardHook, IdentityLog


def cache(
    model: PyTree, *args: Any, where: Where = None, inputs: bool = False, **kwargs: Any
) -> tuple[Any, dict[str, Any]]:
    """Run `model(*args, **kwargs)` and keep the output of every site, or of the selected
    ones.

    !!! Example

        ```python
        output, activations = px.cache(model, tokens, where="blocks")
        activations["blocks"]  # every block's output, stacked along the scan
        ```

    **Arguments:**

    - `model`: the `eqx.Module` to run (a converted Haiku/NNX/linen model included).
    - `*args`, `**kwargs`: its arguments (other than `where` and `inputs`: for a model
        that takes those, use `px.ForwardHook(model, log_fn=px.IdentityLog())`).
    - `where`: which sites to keep, as in `px.ForwardHook`; `"blocks.1.attn"` keeps one
        step of a stack. `None`: every site that `px.sites(model, *args, inner=True)`
        lists: layers, methods, sown values and the sites inside layers (attention
        weights and scores, functions named with `px.function_sites`).
    - `inputs`: also keep each selected site's `(args, kwargs)` under `"path:in"`
        (what `px.patch(..., inputs=True)` patches).

    **Returns:**

    `(output, cache)`: the model's output and a dict log key -> value, keyed as
    `px.ForwardHook` logs are (`"path"`, `"path@1"` for a second call; inside a
    `vmap`/`scan` body, values stacked along the mapped axes). The cache is data: its
    leaves are arrays, or `None` where the value held something else (a `dtype=`
    argument, a flag), so it passes through `jax.jit`, `jax.vmap` and checkpoints;
    `px.patch` takes those other leaves from the call it patches.
    """
    where = EVERY_SITE if where is None else where
    hooked = ForwardHook(model, log_fn=IdentityLog(), where=where, pre_log_fn=IdentityLog() if inputs else None)
    output, log = hooked(*args, **kwargs)
    # Non-array leaves (Flax's `dtype=jnp.float32` among an attention's inputs) are no
    # JAX type: a jitted function could not return them.
    return output, {key: eqx.filter(value, eqx.is_array) for key, value in log.items()}
