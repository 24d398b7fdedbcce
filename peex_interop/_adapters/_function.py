"""The pure-function adapter: where a call of a layer *function* becomes a call site.

A pure-function model is `f(params, x, ...)` whose layers are plain functions taking a
subtree of the params as their first argument (zephyr's
`mlp(params["encoder"]["mlp_1"], x, [...])`, hand-written JAX models in that style).
`from_function` wraps `(f, params)` as an `eqx.Module`. While a hooking context is
active in the calling thread, every module-global name bound to one of the designated
layer functions, in every loaded module and in `f`'s own globals, is replaced for the
duration of the call by a function that hands the call to `_context.call_site`.
Every module, because libraries call their layers through their *own* globals:
zephyr's `mlp` calls `zephyr._nets.mlp.linear`, not `zephyr.nets.linear`.

A call is named by the path of the params subtree it receives (`encoder.mlp_1.0`): a
map `id(subtree) -> paths` is built from the params inside the traced call (jit
rebuilds the tree once per trace, and the model indexes into that very tree; one
subtree object at two paths is copied apart eagerly, as jit does). Subtrees rebuilt
inside a vmap/scan body hold the body's input tracers, which `_context.origin` maps
back to the params' arrays. A layer function called without parameters (its first
argument holds no arrays, e.g. a dropout) is named `<enclosing layer>.<function name>`.
A call with one of zephyr's placeholders (`linear(_, _, 6)`) makes a partial, not a
layer call: the partial's call, once it has its params and input, is. The first layer
function given a params subtree in a call is that layer's; another layer function given
the same subtree is a method of it (`embed(p["embedder"], t)` is `embedder`, then
`attend(p["embedder"], h)` is `embedder.attend`, kind `"method"`), as a class's other
methods are in the other libraries.
"""

import collections
import functools
import importlib
import inspect
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import PyTree

from .._engine import (
    KINDS,
    NO_DECLARATIONS,
    ORIGINAL,
    AbstractConverted,
    Container,
    Declarations,
    Declared,
    Layout,
    ThreadStack,
    active,
    as_stored,
    at,
    bindings,
    call_site,
    declare,
    is_abstract,
    origin,
    patched,
    refuse,
    refuse_if_passed_through,
    unwrap,
)
from .._errors import HookError

Path = tuple[str, ...]

# zephyr's nets, by qualified name (zephyr itself is not imported here).
ZEPHYR_KINDS: dict[str, str] = {
    "zephyr._nets.linear.linear": "linear",
    "zephyr._nets.linear.branch_linear": "linear",
    "zephyr._nets.linear.linear_like": "linear",
    **{f"zephyr._nets.linear.conv_{n}d": "conv" for n in (1, 2, 3)},
    **{f"zephyr._nets.linear.conv_transpose_{n}d": "conv" for n in (1, 2, 3)},
    "zephyr._nets.linear.conv_general": "conv",
    "zephyr._nets.linear.conv_transpose_general": "conv",
    "zephyr._nets.mlp.mlp": "container",
    "zephyr._nets.composition.sequential": "container",
    "zephyr._nets.norm.layer_norm": "norm",
    "zephyr._nets.attention.single_head_attention": "attention",
    "zephyr._nets.attention.multi_head_attention": "attention",
    "zephyr._nets.attention.multi_head_self_attention": "attention",
    "zephyr._nets.linear_attention.multi_head_linear_attention": "attention",
    "zephyr._nets.linear_attention.linear_transformer_block": "container",
    "zephyr._nets.embed.token_embed": "embedding",
    "zephyr._nets.dropout.dropout": "dropout",
    "zephyr._nets.pool.max_pool": "pool",
    "zephyr._nets.pool.avg_pool": "pool",
}


def _qualified_name(function: Callable) -> str:
    return f"{getattr(function, '__module__', '')}.{getattr(function, '__qualname__', '')}"


def default_kind(function: Callable) -> str:
    """The kind (`px.KINDS`) of a known library layer function, else `"other"`."""
    return ZEPHYR_KINDS.get(_qualified_name(function), "other")


class FunctionLayer:
    """One call of a layer function, as `where=` predicates and `px.summary` see it:
    `layer.function` is the function, `layer.params` the params subtree it received.
    Each function gets its own subclass, named after it (`px.summary` shows `linear`)."""

    __slots__ = ("params",)
    function: Callable

    def __init__(self, params: Any):
        self.params = params

    def calls(self, function: Callable) -> bool:
        """Whether this is a call of `function`. Use it in `where=` predicates rather
        than `layer.function is f`: during a hooked call, the global name `f` is bound
        to its routed replacement."""
        return unwrap(function) is self.function


_layer_types: dict[Callable, type] = {}


def layer_type(function: Callable) -> type:
    """The `FunctionLayer` subclass of one layer function (for `where=` types)."""
    function = unwrap(function)
    cls = _layer_types.get(function)
    if cls is None:
        name = getattr(function, "__name__", "layer")
        cls = type(name, (FunctionLayer,), {"__slots__": (), "function": staticmethod(function)})
        _layer_types[function] = cls
    return cls


def _nodes(tree: Any, prefix: Path = ()) -> Iterator[tuple[Path, Any]]:
    """Every container (dict, list, tuple) and array of a params tree, pre-order."""
    if isinstance(tree, Mapping):
        yield prefix, tree
        for key, child in tree.items():
            yield from _nodes(child, (*prefix, str(key)))
    elif isinstance(tree, (list, tuple)):
        yield prefix, tree
        for index, child in enumerate(tree):
            yield from _nodes(child, (*prefix, str(index)))
    elif eqx.is_array(tree):
        yield prefix, tree


def _size(tree: Any) -> int:
    return sum(
        leaf.size for leaf in jax.tree.leaves(tree) if eqx.is_array(leaf) and jnp.issubdtype(leaf.dtype, jnp.inexact)
    )


class FunctionModule(AbstractConverted):
    """A pure-function model `fn(params, *args)` with its params as one `eqx.Module`:
    the params are the pytree's leaves, the function and its layer functions static.
    Build it with `px.from_function`; calling it is `fn(params, *args, **kwargs)`.
    """

    params: PyTree
    fn: Callable = eqx.field(static=True)
    kinds: tuple[tuple[Callable, str], ...] = eqx.field(static=True)
    # Layers are listed from the params tree: a layer function given none (a dropout)
    # is only known during the call.
    lists_every_layer: ClassVar[bool] = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the model.

        **Arguments:**

        - `*args`, `**kwargs`: the model's arguments after `params` (inputs and
            hyper-parameters, as they are).

        **Returns:**

        What `fn(params, *args, **kwargs)` returns.
        """
        if not active():
            return self.fn(self.params, *args, **kwargs)
        call = _Call(self, self.params)
        functions = [function for function, _ in self.kinds]
        targets = [(owner, name, _routed) for owner, name in bindings(functions, self.fn)]
        with patched(targets):
            _calls().append(call)
            try:
                output = self.fn(call.params, *args, **kwargs)
            finally:
                _calls().remove(call)
        if not call.reached and functions:
            # Not even a call without parameters: an empty log would read as "nothing
            # to log" where the model calls its layers through names not replaced.
            names = ", ".join(sorted(_name(function) for function in functions))
            raise HookError(
                f"px.from_function({_name(self.fn)}): no call of its layer functions ({names}) was reached during "
                "the hooked call: the model calls them through a name that is not a module global (a closure, "
                "an object attribute, a functools.partial made before the call), or calls other functions; "
                "designate the functions it calls, through module-global names"
            )
        return output

    def layers(self) -> dict[Path, None]:
        """Every path of the params tree (containers and arrays): a layer call is named
        by the subtree it receives. Layer functions called without parameters are
        named during the call only."""
        return {path: None for path, _ in _nodes(self.params) if path}

    def parameter_counts(self) -> tuple[int, int]:
        """`(trainable, 0)`: the size of the params' float arrays."""
        return _size(self.params), 0

    def layer_parameter_counts(self, layer: FunctionLayer) -> tuple[int, int]:
        """As `parameter_counts`, for the subtree one layer call received."""
        return _size(layer.params), 0

    def layer_kind(self, layer: FunctionLayer) -> str:
        """The kind (`px.KINDS`) given to the layer's function."""
        return dict(self.kinds).get(type(layer).function, "other")

    def read_layer(
        self, local: Path, modules: dict | None = None, declarations: Declarations = NO_DECLARATIONS
    ) -> Layout | Container:
        """The parameters of the subtree at `local` in named axes
        (`_engine/_layouts.py`), read with the `x @ w` convention: kernels are
        `(in, out)` / `(*window, in, out)`. `modules` (local path -> the
        `FunctionLayer` seen during a call) tells the layer's kind."""
        return _function_layout(self, local, modules or {}, declarations)

    def detached(self, module: FunctionLayer) -> FunctionLayer:
        """The layer without the params it received: its type tells its function."""
        return type(module)(None)

    def write_layer(
        self, local: Path, values: dict[str, Any], modules: dict | None = None,
        declarations: Declarations = NO_DECLARATIONS,
    ) -> "FunctionModule":
        """A copy with `values` (from `_layouts.fit`) in the subtree at `local`: new
        containers along the way, the user's params are never mutated."""
        declared = _function_spec(self, local, modules or {}, declarations)
        params = self.params
        for name, value in values.items():
            params = _replaced(params, (*local, declared.params[name].where[0]), value)
        return eqx.tree_at(lambda m: m.params, self, params)


# -- naming calls -----------------------------------------------------------------------
def _name(function: Callable) -> str:
    return getattr(function, "__name__", repr(function))


def _ids(tree: Any) -> dict[int, tuple[list[Path], Any]]:
    """`id(node) -> (every path of the node, node)` for the containers and arrays."""
    ids: dict[int, tuple[list[Path], Any]] = {}
    for path, node in _nodes(tree):
        ids.setdefault(id(node), ([], node))[0].append(path)
    return ids


class _Call:
    """One hooked call of one `FunctionModule`: the params the model runs on and how its
    layer calls are named."""

    def __init__(self, owner: FunctionModule, params: Any):
        self.owner = owner
        self.ids = _ids(params)
        if any(len(paths) > 1 and not eqx.is_array(node) for paths, node in self.ids.values()):
            # One subtree object at two paths (`{"enc": shared, "dec": shared}`): each
            # path gets its own copy, as under `jax.jit`, so that a call is named by the
            # key it is reached through, eagerly as under jit. Arrays stay shared.
            params = jax.tree.unflatten(jax.tree.structure(params), jax.tree.leaves(params))
            self.ids = _ids(params)
        self.params = params
        self.running: list[Path] = []
        # How many layer calls were routed to call sites.
        self.reached = 0
        # The first layer function each params subtree was given: another one given the
        # same subtree is a method of that layer (`embedder.attend`).
        self.first_function: dict[Path, Callable] = {}

    def method_of(self, function: Callable, path: Path) -> str | None:
        """`None` for a call of the layer at `path`, or the method name for a call of
        another layer function on the same params (the tied embedding's `attend`)."""
        first = self.first_function.setdefault(path, function)
        return None if first is function else _name(function)

    def path_of(self, function: Callable, params: Any) -> Path:
        entry = self.ids.get(id(params))
        if entry is not None:
            return self._one(function, entry[0])
        leaves = [(path, node) for path, node in _nodes(params) if eqx.is_array(node)]
        if not leaves:
            # No parameters: named after the function, inside the running layer.
            return (*(self.running[-1] if self.running else ()), getattr(function, "__name__", "layer"))
        # Each array votes for the subtrees holding it at its relative path: tied
        # arrays vote for several, the others decide.
        votes: collections.Counter[Path] = collections.Counter()
        for relative, leaf in leaves:
            for found in self.ids.get(id(origin(leaf)), ([], None))[0]:
                if found[len(found) - len(relative) :] == relative:
                    votes[found[: len(found) - len(relative)]] += 1
        if votes:
            most = max(votes.values())
            return self._one(function, [path for path, count in votes.items() if count == most])
        caller = ".".join(self.running[-1]) if self.running else ""
        # Parameters that a transform the engine cannot thread received as arguments are
        # its tracers: that transform is what to name.
        refuse_if_passed_through(f"call of layer function {_name(function)!r}", params)
        raise HookError(
            f"cannot name the call of layer function {_name(function)!r} "
            f"(called inside layer {caller!r}): its first argument holds arrays that are "
            "not part of the model's params (a subtree built during the call, or params "
            "passed through a transform peex_interop does not thread). Pass it a subtree "
            "of the params the model was built with."
        )

    def _one(self, function: Callable, paths: list[Path]) -> Path:
        if len(paths) == 1:
            return paths[0]
        raise HookError(
            f"cannot name the call of layer function {_name(function)!r}: "
            f"the arrays it receives are the same objects at several paths of the params "
            f"({', '.join(repr('.'.join(path)) for path in paths)}), so nothing tells which one it "
            "was reached through (under jax.jit each path is its own tracer). Give each "
            "path its own arrays, or call the hooked model under jit."
        )


_calls_in_thread = ThreadStack()


def _calls() -> list[_Call]:
    return _calls_in_thread.items


def _routed(original: Callable) -> Callable:
    first = _first_parameter(original)
    layer = layer_type(original)

    @functools.wraps(original)
    def routed(*args: Any, **kwargs: Any) -> Any:
        calls = _calls()
        if not calls or not active():
            return original(*args, **kwargs)
        hole_aware = _placeholder_partial(args, kwargs)
        if hole_aware is not None:
            # `linear(_, _, 6)` only makes a partial; its call, given the params and the
            # input, is the layer call: zephyr's own partial, around this function.
            return hole_aware(routed)(*args, **kwargs)
        params = args[0] if args else kwargs.get(first)
        call = calls[-1]
        path = call.path_of(original, params)
        call.reached += 1
        call.running.append(path)
        try:
            layer_call = functools.partial(_activations, original, path)
            return call_site(
                call.owner, layer_call, args, kwargs, local=path, module=layer(params), signature=original,
                member=call.method_of(original, path),
            )
        finally:
            call.running.pop()

    setattr(routed, ORIGINAL, original)
    return routed


def _activations(function: Callable, path: Path, *args: Any, **kwargs: Any) -> Any:
    output = function(*args, **kwargs)
    if any(callable(leaf) and not eqx.is_array(leaf) for leaf in jax.tree.leaves(output)):
        # A partial application the adapter does not know: the computation would run
        # when the returned function is called, unhooked.
        raise HookError(
            f"layer {'.'.join(path)!r}: its function {_name(function)!r} "
            "returned a function, not activations (a partial application?), whose "
            "computation would run unhooked. Designate the function that computes the "
            "layer, called with its params and input."
        )
    return output


_PLACEHOLDER = "zephyr.functools.partial.PlaceholderHole"


def _placeholder_partial(args: tuple, kwargs: dict) -> Callable | None:
    """zephyr's `hole_aware` if one of the arguments is its placeholder `_` (which makes
    a call of a zephyr net a partial application), else None."""
    for value in (*args, *kwargs.values()):
        if any(_qualified_name(cls) == _PLACEHOLDER for cls in type(value).__mro__):
            return importlib.import_module(_PLACEHOLDER.rsplit(".", 1)[0]).hole_aware
    return None


def _first_parameter(function: Callable) -> str:
    try:
        return next(iter(inspect.signature(function).parameters))
    except (TypeError, ValueError, StopIteration):
        return "params"


# -- parameter layouts (px.transfer_params) ------------------------------------------
# Function models' facts, read with the `x @ w` convention: a kernel (`weights`, `w`,
# `kernel`) is (in, out) / (*window, in, out) and a `bias` (out,); zephyr's
# `layer_norm` keeps `scale` and `offset` shaped (1, ..., features); an embedding is
# (vocab, features); zephyr's attention projections `q_proj`/`k_proj`/`v_proj` are
# `linear`s merging (heads, head_dim) head-major, and `out_proj` the reverse.

_KERNELS = ("weights", "w", "kernel")
_BIASES = ("bias", "b")
_EMBEDDINGS = ("token_embeddings", "embedding", "embeddings")
_ATTENTION_INPUTS = ("q_proj", "k_proj", "v_proj")
_ATTENTION = {*_ATTENTION_INPUTS, "out_proj"}


def _node(tree: Any, path: Path) -> Any:
    for part in path:
        if isinstance(tree, Mapping):
            key = next((k for k in tree if str(k) == part), None)
            if key is None:
                return None
            tree = tree[key]
        elif isinstance(tree, (list, tuple)) and part.isdigit() and int(part) < len(tree):
            tree = tree[int(part)]
        else:
            return None
    return tree


def _own(tree: Any) -> dict[str, Any]:
    if not isinstance(tree, Mapping):
        return {}
    return {str(name): value for name, value in tree.items() if eqx.is_array(value) or is_abstract(value)}


def _one_of(own: dict[str, Any], names: Sequence[str]) -> str | None:
    return next((name for name in names if name in own), None)


def _function_spec(model: FunctionModule, local: Path, modules: dict, declarations: Declarations) -> Declared:
    """The layout of the subtree at `local`: the user's declaration, else the layer
    functions' conventions, else as stored."""
    layer = modules.get(local)
    own = _own(_node(model.params, local))
    return declarations.find(layer, ".".join(local)) or _built_in(model, local, modules) or as_stored(own)


def _built_in(model: FunctionModule, local: Path, modules: dict) -> Declared | None:
    path = ".".join(local)
    own = _own(_node(model.params, local))
    layer, parent = modules.get(local), modules.get(local[:-1]) if local else None
    kind = model.layer_kind(layer) if layer is not None else None
    kernel, bias = _one_of(own, _KERNELS), _one_of(own, _BIASES)
    if kernel is not None:
        ndim = own[kernel].ndim
        siblings = _node(model.params, local[:-1]) if local else None
        attention = (
            model.layer_kind(parent) == "attention" if parent is not None
            else isinstance(siblings, Mapping) and {str(k) for k in siblings} >= _ATTENTION
        )
        heads = ("heads", "head_dim")
        if attention and local[-1] in _ATTENTION_INPUTS:
            return declare("attention_in", kernel=at(kernel, "in", heads), bias=at(bias or "bias", heads))
        if attention and local[-1] == "out_proj":
            return declare("attention_out", kernel=at(kernel, heads, "out"), bias=at(bias or "bias", "out"))
        if kind == "linear" or (kind is None and ndim == 2):
            return declare("linear", kernel=at(kernel, "in", "out"), bias=at(bias or "bias", "out"))
        if kind == "conv" and "transpose" in getattr(getattr(layer, "function", None), "__name__", ""):
            # zephyr's conv_transpose_* share the conv kind; their kernels are not mapped.
            raise refuse(path, "a conv-transpose function's kernel layout is not mapped")
        if kind == "conv":
            window = tuple(f"window{i}" for i in range(ndim - 2))
            return declare("conv", kernel=at(kernel, *window, "in", "out"), bias=at(bias or "bias", "out"))
        raise refuse(
            path, f"a kernel of {ndim} axes: a conv or stacked linear layers, which one is known from a call "
            "(pass inputs=)"
        )
    embedding = _one_of(own, _EMBEDDINGS)
    if embedding is not None:
        return declare("embedding", embedding=at(embedding, "vocab", "features"))
    if own and set(own) <= {"scale", "offset"}:
        some = next(iter(own.values()))
        feature = (*[()] * (some.ndim - 1), "features")
        return declare("norm", scale=at("scale", *feature), offset=at("offset", *feature))
    return None


def _function_layout(
    model: FunctionModule, local: Path, modules: dict, declarations: Declarations
) -> Layout | Container:
    path = ".".join(local)
    node = _node(model.params, local)
    if node is None:
        raise HookError(f"transfer_params: no params subtree at {path!r}")
    if not _own(node):
        parts = tuple(".".join(p) for p, n in _nodes(node) if p and _own(n))
        if parts:
            return Container(parts)
    declared = _function_spec(model, local, modules, declarations)
    return declared.read(lambda places: _own(node).get(places[0]))


def _replaced(tree: Any, path: Path, value: Any) -> Any:
    # New containers along the path: the user's params are never mutated.
    head, *rest = path
    if isinstance(tree, Mapping):
        key = next((k for k in tree if str(k) == head), head)
        return {**tree, key: _replaced(tree[key], tuple(rest), value) if rest else value}
    items = list(tree)
    items[int(head)] = _replaced(items[int(head)], tuple(rest), value) if rest else value
    return type(tree)(items)


def from_function(
    fn: Callable,
    params: PyTree,
    *,
    layers: Sequence[Callable] | Mapping[Callable, str],
) -> FunctionModule:
    """Expose a pure-function model `fn(params, *args)` as an `eqx.Module` that every
    peex_interop hook works on, without changing its code.

    **Arguments:**

    - `fn`: the model, called as `fn(params, *args, **kwargs)`.
    - `params`: its params (dicts, lists and tuples of arrays; never mutated).
    - `layers`: the layer functions whose calls are layers, e.g.
        `[zephyr.nets.mlp, zephyr.nets.linear, my_block]`; a mapping gives their kinds
        (`{my_dense: "linear"}`; zephyr's nets have theirs, others default to
        `"other"`). Each call of one of them is a layer named by the path of the params
        subtree it receives as first argument (`encoder.mlp_1.0`).

    **Returns:**

    A `FunctionModule` called with the model's arguments after `params`.
    """
    if not callable(fn):
        raise TypeError(f"from_function expects the model function, got {type(fn).__name__}")
    kinds = dict(layers) if isinstance(layers, Mapping) else {function: default_kind(function) for function in layers}
    for function, kind in kinds.items():
        if not callable(function):
            raise TypeError(f"from_function: layers= takes functions, got {function!r}")
        if kind not in KINDS:
            raise HookError(f"from_function: unknown kind {kind!r} for {function!r}; kinds are: {', '.join(KINDS)}")
    if not kinds:
        raise HookError("from_function: name the layer functions with layers=[...]")
    return FunctionModule(params, fn, tuple(kinds.items()))

