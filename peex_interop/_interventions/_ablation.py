"""Ablations as ready hooks: a layer's value replaced by zeros or by its mean over a
batch of inputs."""

from collections.abc import Mapping
from typing import Any

import equinox as eqx
import jax.numpy as jnp
import jax.tree_util as jtu

from .._engine import CallSite
from .._hooks import AbstractHook
from ._patch import cached_at


def _batch_mean(x: Any) -> Any:
    return jnp.mean(x, axis=0) if eqx.is_array(x) else x


class ZeroAblation(AbstractHook):
    """A hook that replaces the layer's value by zeros (`px.ForwardHook(model,
    hook_fn=px.ZeroAblation(), where="blocks.1.attn")`)."""

    def __call__(self, args: Any) -> Any:
        return jtu.tree_map(lambda x: jnp.zeros_like(x) if eqx.is_array(x) else x, args)


class MeanAblation(AbstractHook):
    """A hook that replaces the layer's value by its mean over a batch of inputs: the
    mean over the leading axis of a cache taken under an outer `jax.vmap`
    (`jax.vmap(lambda x: px.cache(model, x))(batch)`). Inside `vmap`/`scan` bodies of
    the model, each call gets its own mean (`px.CallSite.log_index`)."""

    means: dict[str, Any]

    def __init__(self, cache: Mapping[str, Any]):
        """**Arguments:**

        - `cache`: a batched cache: every entry has the batch axis in front.
        """
        self.means = {key: jtu.tree_map(_batch_mean, value) for key, value in cache.items()}

    def __call__(self, args: Any, site: CallSite) -> Any:
        return cached_at(self.means, site, what="the MeanAblation cache")
