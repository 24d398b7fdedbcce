"""`px.cache`: one forward pass that returns the output and every selected layer's value
(TransformerLens's `run_with_cache`), the input of `px.patch` and `px.MeanAblation`."""

from typing import Any

from jaxtyping import PyTree

from .._engine import Where
from .._hooks import ForwardHook, IdentityLog


def cache(
    model: PyTree, *args: Any, where: Where = None, inputs: bool = False, **kwargs: Any
) -> tuple[Any, dict[str, Any]]:
    """Run `model(*args, **kwargs)` and keep the output of every selected layer.

    !!! Example

        ```python
        output, activations = px.cache(model, tokens, where="blocks")
        activations["blocks"]  # every block's output, stacked along the scan
        ```

    **Arguments:**

    - `model`: the `eqx.Module` to run (a converted Haiku/NNX/linen model included).
    - `*args`, `**kwargs`: its arguments (other than `where` and `inputs`: for a model
        that takes those, use `px.ForwardHook(model, log_fn=px.IdentityLog())`).
    - `where`: which layers to keep, as in `px.ForwardHook` (`None`: every layer);
        `"blocks.1.attn"` keeps one step of a stack.
    - `inputs`: also keep each selected layer's `(args, kwargs)` under `"path:in"`
        (what `px.patch(..., inputs=True)` patches).

    **Returns:**

    `(output, cache)`: the model's output and a dict log key -> value, keyed as
    `px.ForwardHook` logs are (`"path"`, `"path@1"` for a second call; inside a
    `vmap`/`scan` body, values stacked along the mapped axes).
    """
    hooked = ForwardHook(model, log_fn=IdentityLog(), where=where, pre_log_fn=IdentityLog() if inputs else None)
    output, log = hooked(*args, **kwargs)
    return output, dict(log)
