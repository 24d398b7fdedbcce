"""Ablations as ready hooks: a layer's value replaced by zeros or by its mean over a
batch of inputs."""

from collections.abc import Mapping
from typing import Any

import equinox as eqx
import jax.numpy as jnp
import jax.tree_util as jtu

from .._engine import CallSite
from .._errors import HookError
from .._hooks import AbstractHook
from ._patch import cached_at, put_back


def _batch_mean(x: Any) -> Any:
    return jnp.mean(x, axis=0) if eqx.is_array(x) else x


class ZeroAblation(AbstractHook):
    """A hook that replaces the layer's value by zeros (`px.ForwardHook(model,
    hook_fn=px.ZeroAblation(), where="blocks.1.attn")`)."""

    def __call__(self, args: Any) -> Any:
        return jtu.tree_map(lambda x: jnp.zeros_like(x) if eqx.is_array(x) else x, args)


class MeanAblation(AbstractHook):
    """A hook that replaces the layer's value by its mean over a batch of inputs.

    Two kinds of batch, told apart by `axis`:

    - `axis=None` (the default): the batch is the leading axis an outer `jax.vmap`
        added (`jax.vmap(lambda x: px.cache(model, x))(batch)`, for a model that takes
        one example); the mean has the shape of one call's value. Inside `vmap`/`scan`
        bodies of the model, each call gets its own mean (`px.CallSite.log_index`).
    - `axis=i`: the batch is an axis of the model's own values (every LLM runs its
        batch itself: `px.cache(model, tokens)` with `tokens` of shape `(batch, seq)`);
        the mean over axis `i` of the value the call had in the cache is broadcast back
        along that axis to the value's shape at call time, whatever the batch size.
    """

    means: dict[str, Any]
    axis: int | None = eqx.field(static=True)

    def __init__(self, cache: Mapping[str, Any], axis: int | None = None):
        """**Arguments:**

        - `cache`: a cache from `px.cache`.
        - `axis`: `None` for a cache taken under an outer `jax.vmap` (every entry has the
            batch axis in front); an int for the batch axis of the model's own values
            (`0` for a batch-first model's outputs), in one call's value.
        """
        self.axis = axis
        if axis is None:
            self.means = {key: jtu.tree_map(_batch_mean, value) for key, value in cache.items()}
        else:
            # The axis is one of a call's value, whose entry may have the steps of a stack
            # in front: the mean is taken per call (`__call__`).
            self.means = dict(cache)

    def __call__(self, args: Any, site: CallSite) -> Any:
        cached = cached_at(self.means, site, what="the MeanAblation cache")
        if self.axis is not None:
            axis = self.axis
            return jtu.tree_map(lambda c, x: _broadcast_mean(c, x, axis, site.path), cached, args, is_leaf=_is_none)
        means = put_back(cached, args)
        for mean, current in zip(jtu.tree_leaves(cached), jtu.tree_leaves(eqx.filter(args, eqx.is_array))):
            if jnp.shape(mean) != jnp.shape(current):
                raise HookError(
                    f"px.MeanAblation: layer {site.path!r}: the mean over the cache's leading axis "
                    f"(the batch of an outer jax.vmap) has shape {jnp.shape(mean)}, the call's value "
                    f"{jnp.shape(current)}. A cache of a model that runs its batch itself (no outer "
                    "jax.vmap) takes the batch axis of its values: px.MeanAblation(cache, axis=0)"
                )
        return means


def _broadcast_mean(cached: Any, current: Any, axis: int, path: str) -> Any:
    """The mean of `cached` over `axis`, broadcast to the current value's shape."""
    if cached is None:
        return current  # no array cached here: the current call's leaf
    shape, cached_shape = jnp.shape(current), jnp.shape(cached)
    fits = len(cached_shape) == len(shape) and -len(shape) <= axis < len(shape)
    if fits:
        fits = all(cached_shape[i] == shape[i] for i in range(len(shape)) if i != axis % len(shape))
    if not fits:
        raise HookError(
            f"px.MeanAblation(axis={axis}): layer {path!r}: the cached value has shape "
            f"{cached_shape} and the call's value {shape}: they must be equal but along axis "
            f"{axis}, the batch axis of the model's own values (a cache taken under an outer "
            "jax.vmap takes axis=None)"
        )
    return jnp.broadcast_to(jnp.mean(cached, axis=axis, keepdims=True), shape)


def _is_none(x: Any) -> bool:
    return x is None
