"""Activation patching: layer values replaced by cached ones (`px.CachePatch`, a hook)
and `px.patch`, a model with that hook in place (`px.Patched`).

A cached value is found by the call site: `cache[site.key][site.log_index]` is the value
this very call had when the cache was taken, also inside `vmap`/`scan` bodies, where the
cache entry is stacked along their axes and the index is traced. That is what lets one
patch act per step of a scanned stack and per example, without unrolling anything.
"""

from collections.abc import Callable, Mapping
from typing import Any

import equinox as eqx
import jax.tree_util as jtu
from jaxtyping import PyTree

from .._engine import AbstractTransparent, CallSite, Where
from .._errors import HookError
from .._hooks import AbstractHook, ForwardHook

# `fn(current, cached, site) -> value`: what a patch puts in place of the current value.
PatchFn = Callable[[Any, Any, CallSite], Any]


def cached_at(cache: Mapping[str, Any], site: CallSite, suffix: str = "", what: str = "the cache") -> Any:
    """The value the call at `site` had when `cache` was taken (`suffix=":in"`: its
    inputs). A call selected at one step of a stack (`blocks.1.attn`) also finds its
    value in a cache of the whole stack (`blocks.attn`, stacked along the steps)."""
    key, index = site.key + suffix, site.log_index
    if key not in cache and len(site.log_index) < len(site.indices):
        whole = site.path if site.call_index == 0 else f"{site.path}@{site.call_index}"
        if whole + suffix in cache:
            key, index = whole + suffix, site.indices
    if key not in cache:
        raise HookError(
            f"{what} has no entry {key!r} for layer {site.path!r}: take it with the same "
            f"where= (and inputs=True to patch inputs); its keys: {', '.join(sorted(cache)) or 'none'}"
        )
    return jtu.tree_map(lambda value: value[index] if eqx.is_array(value) else value, cache[key])


def put_back(cached: Any, current: Any) -> Any:
    """The cached arrays in place of the current ones; the leaves a cache holds no
    array for (`None`: a `dtype=` argument, a flag; `px.cache` keeps arrays only) are
    the current call's."""
    return eqx.combine(cached, eqx.filter(current, eqx.is_array, inverse=True))


class CachePatch(AbstractHook):
    """A hook that puts the cached value of each call in place of the current one (see
    `px.patch`, which builds the patched model). Usable in any hook wrapper, e.g. in a
    `{pattern: hook}` mapping beside other hooks."""

    cache: dict[str, Any]
    fn: PatchFn | None
    inputs: bool = eqx.field(static=True)

    def __init__(self, cache: Mapping[str, Any], fn: PatchFn | None = None, *, inputs: bool = False):
        """**Arguments:**

        - `cache`: a cache from `px.cache` (or any log of the same keys).
        - `fn`: `fn(current, cached, site) -> value` for a partial patch (one position,
            one head, a mix); `None` puts the cached value in place.
        - `inputs`: patch the layer's inputs `(args, kwargs)` (as a `pre_hook_fn`, from
            a cache taken with `inputs=True`) instead of its output.
        """
        self.cache = dict(cache)
        self.fn = fn
        self.inputs = inputs

    def __call__(self, args: Any, site: CallSite) -> Any:
        cached = put_back(cached_at(self.cache, site, ":in" if self.inputs else ""), args)
        return cached if self.fn is None else self.fn(args, cached, site)


class Patched(AbstractTransparent):
    """A model whose selected layer values are replaced by cached ones (made by
    `px.patch`). Calling it returns the model's output; it is transparent to layer
    paths, so it can be hooked, logged and patched again."""

    hooked: ForwardHook

    def __init__(self, hooked: ForwardHook):
        """**Arguments:**

        - `hooked`: the model in a `px.ForwardHook` whose hook patches (`px.patch`
            builds it).
        """
        self.hooked = hooked

    @property
    def model(self) -> Any:
        return self.hooked.model

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """**Arguments:**

        - `*args`, `**kwargs`: the model's own arguments.

        **Returns:**

        The model's output, with the patched layers' values.
        """
        return self.hooked(*args, **kwargs)[0]


def patch(
    model: PyTree,
    cache: Mapping[str, Any],
    where: Where = None,
    *,
    fn: PatchFn | None = None,
    inputs: bool = False,
) -> Patched:
    """Activation patching: `model` with the values of its selected layers replaced by
    those of a cache (taken by `px.cache` on another input).

    !!! Example

        ```python
        _, clean_cache = px.cache(model, clean_tokens, where="blocks")
        patched = px.patch(model, clean_cache, "blocks.1")  # one step of a stack
        output = patched(corrupted_tokens)
        ```

    **Arguments:**

    - `model`: the `eqx.Module` to patch (not modified).
    - `cache`: a dict log key -> value, from `px.cache` (keys as `px.ForwardHook`'s
        logs). Each call takes `cache[site.key][site.log_index]`: the value this call
        had, also inside `vmap`/`scan` bodies (per step of a scanned stack).
    - `where`: which layers to patch, as in `px.ForwardHook` (`"blocks.1.attn"`: one
        step of a stack; it may be taken from a cache of the whole stack). `None`: the
        sites the cache holds (by their keys: `lin@1` is the second call of `lin`).
    - `fn`: `fn(current, cached, site) -> value`, for partial patches (one position,
        one head slice, a mix; `site` is the `px.CallSite`, with `site.step` in a
        stack); `None` puts the cached value in place. Shapes and dtypes must not change.
    - `inputs`: patch the layers' inputs `(args, kwargs)` instead of their outputs
        (from a cache taken with `inputs=True`; `fn` then receives those pairs).

    **Returns:**

    A `px.Patched` model: call it like `model`; it works under `jax.jit` and
    `jax.vmap` (e.g. a `fn` closing over a vmapped layer and position index sweeps
    every patch target in one compiled call). A selected call with no cache entry
    raises `px.HookError` naming the key and the cache's keys.
    """
    if where is None:
        if not cache:
            raise HookError("px.patch: the cache is empty, so where=None selects no layer")
        where = sorted({key.removesuffix(":in") for key in cache})
    return patched_at(model, cache, where, fn, inputs)


def patched_at(model: PyTree, cache: Mapping[str, Any], where: Where, fn: PatchFn | None, inputs: bool) -> Patched:
    """`model` with a `CachePatch` on the calls `where` selects (`None`: every layer),
    on their inputs or outputs."""
    hook = CachePatch(cache, fn, inputs=inputs)
    if inputs:
        return Patched(ForwardHook(model, where=where, pre_hook_fn=hook))
    return Patched(ForwardHook(model, hook_fn=hook, where=where))
