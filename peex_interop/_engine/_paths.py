"""Dotted layer paths over pytrees of `eqx.Module`s."""

import abc
from collections.abc import Iterator
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu

from .._errors import HookError
from ._declarations import NO_DECLARATIONS, Declarations


class AbstractTransparent(eqx.Module):
    """A module that wraps `self.model` without adding a path segment (the hook wrappers):
    `ForwardHook(mlp).model.linear1` is logged as `linear1`, so wrappers nest freely."""

    model: eqx.AbstractVar[Any]

    # Trained as a model (a training step's input and output, with the optimiser's
    # state of the same structure), a wrapper is flattened several times per call: see
    # `AbstractConverted`'s `__getattribute__`.
    __getattribute__ = object.__getattribute__


class AbstractConverted(eqx.Module):
    """A model of another library exposed as one `eqx.Module`: its layers are not pytree
    nodes but are reached through the library's interceptor at call time. `layers`
    lists them ahead of the call, for `where=` validation and `px.module_paths`."""

    # Every jitted call flattens the model, and Equinox's flatten reads `__dict__`
    # through `eqx.Module.__getattribute__`, a Python method (it makes bound methods
    # pytrees): Python's own lookup halves the dispatch cost a converted model adds to
    # its library's jitted call. Its bound methods are therefore plain methods: a
    # transform of `converted.method` sees the model's arrays as constants, so pass
    # the model as an argument instead.
    __getattribute__ = object.__getattribute__

    # Whether `layers()` lists every layer a call can run. Those of Haiku and function
    # models are read off their parameters: a layer without any (an `hk.Sequential`, a
    # dropout function) is only known during the call, so a selection of such a model is
    # checked after its call (`_closed_world.check_reached`), not before.
    lists_every_layer: ClassVar[bool] = True
    # Whether its layers may sow values or mark perturbation points (Flax's
    # `self.sow`, `self.perturb`: sites `<layer>.<name>`, `_sown.py`), whose names only
    # the call tells: a selection naming one is checked after the call.
    sows: ClassVar[bool] = False

    @abc.abstractmethod
    def layers(self) -> dict[tuple[str, ...], Any] | None:
        """Local path -> the library's module (or its type; `None` where unknown), or
        `None` when the layers only come into existence during the call."""

    def known_layers(self) -> dict[tuple[str, ...], Any]:
        """The local paths of the layers this model is known to have, where they are
        not every layer a call can run: `layers()` by default; an adapter whose
        `layers()` is `None` lists what its stored values tell (linen: the paths of
        its variables). After a call, a name or pattern that selected no call is no
        error where it names only such layers, or layers an earlier call of the model
        reached, and none of them ran (`_engine/_known_paths.py`)."""
        return self.layers() or {}

    def method_paths(self) -> tuple[tuple[str, ...], ...]:
        """The local paths of the method sites (`_methods.py`: `("embedder",
        "attend")`) that a call can run, where known ahead of it; `()` otherwise."""
        return ()

    @abc.abstractmethod
    def parameter_counts(self) -> tuple[int, int]:
        """(trainable, non-trainable) numbers of parameters of the whole model."""

    @abc.abstractmethod
    def layer_parameter_counts(self, module: Any) -> tuple[int, int]:
        """(trainable, non-trainable) numbers of parameters of one of the library's
        modules, during its call (submodules included)."""

    @abc.abstractmethod
    def layer_kind(self, module: Any) -> str:
        """The library-independent kind (`px.KINDS`) of one of the library's modules."""

    @abc.abstractmethod
    def read_layer(
        self, local: tuple[str, ...], modules: dict | None = None, declarations: Declarations = NO_DECLARATIONS
    ) -> Any:
        """The parameters of the layer at `local` as a `_layouts.Layout` (named axes),
        or a `_layouts.Container` for a layer without parameters of its own. `modules`
        (local path -> the library's module, as seen during a call) is given where the
        caller ran the model: what the stored parameters alone do not tell.
        `declarations` (`_declarations.Declarations`) are the user's layouts, read before
        the library's; a layer of neither is read as stored."""

    @abc.abstractmethod
    def write_layer(
        self,
        local: tuple[str, ...],
        values: dict[str, Any],
        modules: dict | None = None,
        declarations: Declarations = NO_DECLARATIONS,
    ) -> "AbstractConverted":
        """A copy with the layer at `local` holding `values`: `_layouts.fit`'s output,
        already in this layer's own axes (placed as `read_layer` read them)."""

    # Whether `read_layer` learns from a call what the stored parameters do not tell
    # (`modules`, `detached`): where it does not, a transfer does not run the model.
    layouts_need_calls: ClassVar[bool] = True

    def read_layers(
        self,
        locals_: list[tuple[str, ...]],
        modules: dict | None = None,
        declarations: Declarations = NO_DECLARATIONS,
    ) -> dict[tuple[str, ...], Any]:
        """`read_layer` of several layers: an adapter that rebuilds its library's model
        to read a layer reads them all from one."""
        return {local: self.read_layer(local, modules, declarations) for local in locals_}

    def write_layers(
        self,
        values: dict[tuple[str, ...], dict[str, Any]],
        modules: dict | None = None,
        declarations: Declarations = NO_DECLARATIONS,
    ) -> "AbstractConverted":
        """`write_layer` of several layers (local path -> values): an adapter that
        rebuilds its library's model to write a layer writes them all into one."""
        model = self
        for local, layer_values in values.items():
            model = model.write_layer(local, layer_values, modules, declarations)
        return model

    def carried(self, returned: Any) -> tuple[Any, "AbstractConverted"]:
        """What a call returned, as the call's output and this model carrying the state
        the call left (a decode cache one position on), as its library carries state
        from one call to the next: `px.compare(..., steps=)` runs models so.

        **Arguments:**

        - `returned`: what calling this model returned.

        **Returns:**

        `(output, model)`. A model that carries no state raises an error saying how to
        convert it so that it does.
        """
        raise HookError(
            f"{type(self).__name__} carries no state from one call to the next: convert the model so that its "
            "calls return their state updates"
        )

    def detached(self, module: Any) -> Any:
        """One of the library's modules seen during an abstract call, as `read_layer`'s
        `modules` keep it after the call: with what it tells (its class, its settings),
        without the call's arrays, which are the abstract call's tracers and would leak
        out of it. `None` where `read_layer` needs nothing from calls.

        **Arguments:**

        - `module`: the module, during its call.

        **Returns:**

        The module itself by default (a Haiku module holds no arrays).
        """
        return module


def float_size(tree: Any) -> int:
    """The number of floating-point values in the arrays (or `jax.ShapeDtypeStruct`s, of
    an abstract model) of `tree`: what a parameter count counts."""
    return sum(
        leaf.size for leaf in jtu.tree_leaves(tree)
        if (eqx.is_array(leaf) or isinstance(leaf, jax.ShapeDtypeStruct)) and jnp.issubdtype(leaf.dtype, jnp.inexact)
    )


def join(*parts: str) -> str:
    return ".".join(part for part in parts if part)


def key_name(key: Any) -> str:
    for attribute in ("name", "key", "idx"):
        if hasattr(key, attribute):
            return str(getattr(key, attribute))
    return str(key)


def _is_child(node: Any):
    return lambda x: x is not node and isinstance(x, eqx.Module)


def children(node: eqx.Module) -> Iterator[tuple[tuple[str, ...], Any]]:
    """Direct submodules (through lists, tuples and dicts) and array-or-other leaves of
    `node`, each with its key path relative to `node`."""
    leaves, _ = jtu.tree_flatten_with_path(node, is_leaf=_is_child(node))
    for key_path, leaf in leaves:
        yield tuple(key_name(key) for key in key_path), leaf


def walk(
    node: Any, prefix: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], Any]]:
    """Every module (pre-order, root included) and every non-module leaf under `node`,
    with its key path. Transparent wrappers are skipped over."""
    if isinstance(node, AbstractTransparent):
        yield from walk(node.model, prefix)
        return
    if not isinstance(node, eqx.Module):
        yield prefix, node
        return
    yield prefix, node
    for key_path, child in children(node):
        yield from walk(child, prefix + key_path)


def module_paths(root: Any) -> dict[str, Any]:
    """Dotted path -> module for every layer of `root` (the root itself is `""`),
    including the layers of converted Haiku/NNX models (`None` where the module object
    only exists during a call).

    **Arguments:**

    - `root`: an `eqx.Module` (models of other libraries converted first).

    **Returns:**

    `{path: module}`, the root first.
    """
    check_model(root, "px.module_paths")
    paths: dict[str, Any] = {}
    _add_module_paths(root, paths)
    return paths


def known_module_paths(root: Any) -> dict[str, Any] | None:
    """`module_paths(root)`, or None where some converted model cannot list all its
    layers before it is called (a linen model's layers exist only during a call, a Haiku
    model's without parameters too)."""
    paths: dict[str, Any] = {}
    return paths if _add_module_paths(root, paths) else None


def _add_module_paths(root: Any, paths: dict[str, Any]) -> bool:
    """Add every layer path of `root` to `paths`; returns whether every converted model
    could list its layers. One walk, one `layers()` per converted model: listing an NNX
    model's layers merges its graph (~8 ms for a 50M-parameter LM)."""
    complete = True
    for path, node in walk(root):
        if isinstance(node, eqx.Module):
            paths.setdefault(join(*path), node)
        if isinstance(node, AbstractConverted):
            layers = node.layers()
            complete = complete and layers is not None and node.lists_every_layer
            for local, layer in (layers or {}).items():
                paths.setdefault(join(*path, *local), layer)
    return complete


def check_model(model: Any, wrapper: str) -> None:
    """Refuse anything but an `eqx.Module`, with the way to convert the usual others."""
    if isinstance(model, eqx.Module):
        return
    raise TypeError(
        f"{wrapper}: peex_interop wraps an equinox.Module, got {type(model).__module__}."
        f"{type(model).__qualname__}. Hint: wrap a plain function as "
        "`eqx.nn.Lambda(fn)`; convert a Haiku model with "
        "`px.from_haiku(transformed, params, state)`, a Flax NNX module with "
        "`px.from_nnx(module)`, a Flax linen module with `px.from_linen(module, "
        "variables)` and a function `f(params, x)` with `px.from_function(f, params)`."
    )
