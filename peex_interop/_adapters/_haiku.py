"""The Haiku adapter: where a Haiku module call becomes a call site.

`from_haiku` wraps `(transformed, params, state)` as an `eqx.Module`. While a hooking
context is active, its call runs `apply` inside `hk.intercept_methods`, and the
interceptor hands every selected method call of every Haiku submodule to
`_context.call_site`, with the Haiku module name turned into a dotted local path.
"""

import dataclasses
import functools
import inspect
import re
from collections.abc import Callable, MutableMapping, Sequence
from typing import Any, ClassVar

import equinox as eqx
import haiku as hk
import jax
import jax.numpy as jnp
from haiku._src import base as hk_base  # the frames: Haiku's per-transform Python state
from haiku._src.lift import LiftingModule  # the plumbing of hk.lift and layer_stack
from jaxtyping import PRNGKeyArray, PyTree

from .._engine import _context, _jax, _methods, _shape_pass
from .._engine._declarations import NO_DECLARATIONS, Declarations, Declared, as_stored
from .._engine._errors import HookError
from .._engine._kinds import kind_of
from .._engine._layouts import (
    AS_STORED,
    Container,
    Layout,
    Param,
    axes,
    is_abstract,
    lax_transpose_padding,
    put_like,
    refuse,
)
from .._engine._paths import AbstractConverted
from ._replace import replace

HAIKU_KINDS: dict[type, str] = {
    hk.Linear: "linear",
    hk.ConvND: "conv",
    hk.ConvNDTranspose: "conv",
    hk.MultiHeadAttention: "attention",
    hk.LayerNorm: "norm",
    hk.BatchNorm: "norm",
    hk.GroupNorm: "norm",
    hk.RMSNorm: "norm",
    hk.Embed: "embedding",
    hk.RNNCore: "recurrent",
    hk.MaxPool: "pool",
    hk.AvgPool: "pool",
    hk.Sequential: "container",
    hk.nets.MLP: "container",
}


def _save_haiku_state() -> Callable[[], None]:
    """What a trace of Haiku code advances in this thread's frames, for the engine's
    shape-only passes (`_engine/_shape_pass.py`): the name counters and used names of
    every module being called (a module created in a `jax.vmap` body, or any body the
    engine runs abstractly first, would be named `mlp_1` in the real run), the modules'
    submodule sets, the key sequences (`hk.next_rng_key` would leave the abstract run's
    tracer in them), and the params and state dicts (`hk.set_state`, `init`)."""
    frames = list(hk_base.frame_stack)
    if not frames:
        return lambda: None
    held: list[Any] = []
    sequences = {}
    for frame in frames:
        held.extend(frame.counter_stack)
        held.extend(frame.used_names_stack)
        held.extend(entry.module._submodules for entry in frame.module_stack)  # pyright: ignore[reportPrivateUsage]
        # `apply` freezes the params: only `init` writes them.
        for bundles in (frame.state,) if frame.freeze_params else (frame.params, frame.state):
            if isinstance(bundles, MutableMapping):
                held.append(bundles)
                held.extend(bundle for bundle in bundles.values() if isinstance(bundle, MutableMapping))
        sequences.update({id(rng): rng for rng in frame.rng_stack if rng is not None})
    restore_containers = _shape_pass.containers(held)
    keys = [(rng, rng.internal_state) for rng in sequences.values()]

    def restore() -> None:
        restore_containers()
        for rng, state in keys:
            rng.replace_internal_state(state)

    return restore


_shape_pass.register(_save_haiku_state)


def _size(tree: Any) -> int:
    return sum(leaf.size for leaf in jax.tree.leaves(tree))


def haiku_path(module_name: str) -> tuple[str, ...]:
    """`"mlp/~/linear_0"` -> `("mlp", "linear_0")`: submodule (`/~/`) and name-scope
    (`/`) separators both become path separators, and a module created inside another
    module's method `m` (`"coder/~encode/down"`) sits under that method:
    `("coder", "encode", "down")`."""
    return tuple(
        segment.removeprefix("~") for segment in module_name.split("/") if segment not in ("", "~")
    )


def _layer_methods(methods: Sequence[str] | None) -> tuple[str, ...] | None:
    # A constructor call is not a layer call (and its module has no name yet).
    return None if methods is None else tuple(method for method in methods if method != "__init__")


def _params_path(key: str) -> tuple[str, ...]:
    # Params of modules inside `layer_stack` sit under Haiku's internal scope
    # (`__layer_stack_no_per_layer/lin`) while the module itself is called as `lin`.
    return tuple(segment for segment in haiku_path(key) if not segment.startswith("__"))


def _is_internal(module_name: str) -> bool:
    # Haiku's own plumbing (e.g. layer_stack's `__layer_stack_no_per_layer`, whose call
    # returns params) is not a layer of the user's model.
    return _params_path(module_name) != haiku_path(module_name)


class _Transforms:
    """How one call names the modules of the Haiku transforms run inside the model's
    own. Haiku names the modules of an inner transform as if it were the whole model
    (`mlp/~/linear_0`), while the model keeps the params that `hk.lift` (or
    `layer_stack`, `hk.transparent_lift`) gave that transform under the lift
    (`lifted/mlp/~/linear_0`): such modules are named by the lift that gave out the
    params they run on, or `lifted.mlp.linear_0` and the model's own `mlp.linear_0`
    would be one path."""

    def __init__(self, depth: int):
        self.depth = depth  # the model's own transform: its place in Haiku's context stack
        # The lifts called so far: (path, keys of the params and state given out, ids of
        # the model arrays among them), and those arrays, held so that no id is reused.
        self.lifts: list[tuple[tuple[str, ...], set[str], set[int]]] = []
        self.held: list[Any] = []
        self.lifting = 0  # lift calls running: at init they run the lifted init function

    def local(self, methods: tuple[str, ...] | None, context: Any) -> tuple[str, ...] | None:
        """The path of the module of a layer call (or method site), or None for a call
        that is not one."""
        module, method = context.module, context.method_name
        # Interceptors also see `__init__` (module_name not yet set), every public
        # method, and Haiku's internal modules: only site methods (`methods`, if given)
        # of user modules are calls. Calls inside a lift's call make params, not the
        # model's output.
        if methods is None:
            wanted = method == "__call__" or method in _methods.site_methods(type(module), hk.Module)
        else:
            wanted = method in methods
        if not wanted or isinstance(module, LiftingModule) or self.lifting or _is_internal(module.module_name):
            return None
        return (*self._prefix(module), *haiku_path(module.module_name))

    def run(self, context: Any, next_f: Callable, args: tuple, kwargs: dict) -> Any:
        """Run a call that is not a layer call; the params and state a lift gives out
        are remembered, to name the modules that run on them."""
        module = context.module
        if not isinstance(module, LiftingModule) or context.method_name != "__call__" or self.lifting:
            return next_f(*args, **kwargs)
        self.lifting += 1
        try:
            out = next_f(*args, **kwargs)
        finally:
            self.lifting -= 1
        params, state = out
        arrays = [_array(leaf) for leaf in jax.tree.leaves(out)]
        self.held.extend(arrays)
        path = (*self._prefix(module), *_params_path(module.prefix_name))
        self.lifts.append((path, {*params, *state}, set(map(id, arrays))))
        return out

    def _prefix(self, module: hk.Module) -> tuple[str, ...]:
        """The path of the transform `module` runs in: `()` for the model's own."""
        if len(hk_base.context_stack) <= self.depth:
            return ()
        frame = hk_base.current_frame()
        own = {**module.params_dict(), **module.state_dict()}
        # A module without params of its own runs on its transform's.
        keys = {name.rpartition("/")[0] for name in own} or {*frame.params, *(frame.state or {})}
        arrays = list(own.values()) or jax.tree.leaves(frame.params)
        lifts = [(path, ids) for path, given, ids in self.lifts if keys and keys <= given]
        paths = {path for path, _ in lifts}
        if len(paths) > 1:
            # The same names given out by two lifts: the arrays tell which.
            found = {id(_array(leaf)) for leaf in arrays}
            paths = {path for path, ids in lifts if ids & found}
        if len(paths) != 1:
            given = "no hk.lift of this call gave out" if not lifts else "several hk.lift calls gave out"
            raise HookError(
                f"the Haiku module {module.module_name!r} runs in an inner hk.transform on params that {given}: "
                "its path in the model is unknown, so it can be neither selected nor skipped; give the inner "
                "apply the params its hk.lift returns, unchanged"
            )
        return paths.pop()


def _array(leaf: Any) -> Any:
    """The array of the call that `leaf` stands for: the model's own, through the bodies
    the engine threads, and a batch tracer's value (a vmap the engine does not thread,
    as in `haiku_names`, maps its inputs along axis 0 into tracers holding them)."""
    leaf = _context.origin(leaf)
    while isinstance(leaf, _jax.BatchTracer):
        leaf = leaf.val
    return leaf


class _AbstractHaiku(AbstractConverted):
    """Routes Haiku method calls made during `run` to the engine's call sites."""

    methods: eqx.AbstractVar[tuple[str, ...] | None]
    # Modules are listed from the params and state: an `hk.Sequential`, `hk.DeepRNN` or
    # other module without parameters of its own is only known during the call.
    lists_every_layer: ClassVar[bool] = False

    def _intercepted(self, run: Callable[[], Any], *, applies: bool) -> Any:
        # `applies`: whether `run` opens the model's own transform (`apply`) or runs in
        # the enclosing one.
        if not _context.active():
            return run()
        transforms = _Transforms(len(hk_base.context_stack) + applies)
        interceptor = functools.partial(self._intercept, transforms)
        with hk.intercept_methods(interceptor):
            return run()

    def _intercept(self, transforms: _Transforms, next_f, args, kwargs, context):
        local = transforms.local(self.methods, context)
        if local is None:
            return transforms.run(context, next_f, args, kwargs)
        method = None if context.method_name == "__call__" else context.method_name
        return _context.call_site(
            self, next_f, args, kwargs, local=local, module=context.module, signature=context.orig_method,
            member=method,
        )

    def layer_kind(self, module: hk.Module) -> str:
        return kind_of(module, HAIKU_KINDS)

    def layer_parameter_counts(self, module: hk.Module) -> tuple[int, int]:
        # Haiku keeps non-trained values (BatchNorm's moving averages) in state.
        return _size(module.params_dict()), _size(module.state_dict())


class HaikuFunction(_AbstractHaiku):
    """A function that creates and calls Haiku modules, run *inside* the user's own
    `hk.transform`: wrap it with a hook wrapper there to hook its modules."""

    fn: Callable
    methods: tuple[str, ...] | None = eqx.field(static=True)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._intercepted(lambda: self.fn(*args, **kwargs), applies=False)

    def layers(self) -> None:
        return None  # the modules are created by the call itself

    def parameter_counts(self) -> tuple[int, int]:
        raise TypeError(
            "a HaikuFunction's parameters live in the enclosing hk.transform: count them "
            "on its params, or convert the model with px.from_haiku"
        )

    def read_layer(
        self, local: tuple[str, ...], modules: dict | None = None, declarations: Declarations = NO_DECLARATIONS
    ) -> Layout:
        raise TypeError(_NO_PARAMS.format("read"))

    def write_layer(
        self, local: tuple[str, ...], values: dict[str, Any], modules: dict | None = None,
        declarations: Declarations = NO_DECLARATIONS,
    ) -> "HaikuFunction":
        raise TypeError(_NO_PARAMS.format("write"))


_NO_PARAMS = (
    "a HaikuFunction's parameters live in the enclosing hk.transform: px.transfer_params "
    "cannot {} them; convert the model with px.from_haiku"
)


def haiku_function(fn: Callable, *, methods: Sequence[str] | None = None) -> HaikuFunction:
    """Make `fn` hookable inside your own `hk.transform`ed function.

    **Arguments:**

    - `fn`: a function that builds and calls Haiku modules.
    - `methods`: the Haiku module methods whose calls are sites; by default `__call__`
        and every method site (`vq.quantize`: see "What is a site" in the engine
        docs).

    **Returns:**

    A `HaikuFunction` to pass to `px.ForwardHook` inside the transformed function;
    return the log from the transformed function to get it out.
    """
    # By keyword: `methods` is declared (abstract) on the base class, so type checkers
    # put it first in the generated `__init__`, while Equinox puts it after `fn`.
    return HaikuFunction(fn=fn, methods=_layer_methods(methods))


class HaikuModule(_AbstractHaiku):
    """A Haiku transformed function with its params (and state) as one `eqx.Module`.

    Call it with the transformed function's own arguments; it returns what `apply`
    returns for them: the output, or `(output, new_state)` for
    `hk.transform_with_state`. Params and state are pytree leaves (train them with
    `eqx.filter_grad` + optax; `converted.params` is a plain Haiku params dict).
    """

    params: PyTree
    state: PyTree
    rng: PRNGKeyArray | None
    apply_fn: Callable = eqx.field(static=True)
    stateful: bool = eqx.field(static=True)
    takes_rng: bool = eqx.field(static=True)
    methods: tuple[str, ...] | None = eqx.field(static=True)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._intercepted(lambda: self.apply_fn(*self._apply_inputs(), *args, **kwargs), applies=True)

    def _apply_inputs(self) -> tuple:
        inputs = (self.params, self.state) if self.stateful else (self.params,)
        return (*inputs, self.rng) if self.takes_rng else inputs

    def with_state(self, state: PyTree) -> "HaikuModule":
        """The same model carrying `state` (e.g. the `new_state` a call returned)."""
        return replace(self, state=state)

    def carried(self, returned: Any) -> tuple[Any, "HaikuModule"]:
        """`(output, model)` from what a call of an `hk.transform_with_state` model
        returned: the model holding its `new_state`, as `apply` with state is carried
        forward."""
        if not self.stateful:
            raise HookError("this Haiku model has no state to carry (it is not from hk.transform_with_state)")
        output, state = returned
        return output, self.with_state(state)

    def with_rng(self, rng: PRNGKeyArray | None) -> "HaikuModule":
        """The same model using `rng` for its next calls (dropout, sampling)."""
        return replace(self, rng=rng)

    def layers(self) -> dict[tuple[str, ...], Any]:
        # Haiku modules exist only during a call; their names are known from the
        # params/state keys (parents included, as prefixes).
        paths = {}
        for name in (*self.params, *(self.state or {})):
            path = _params_path(name)
            for end in range(1, len(path) + 1):
                paths[path[:end]] = None
        return paths

    def parameter_counts(self) -> tuple[int, int]:
        return _size(self.params), _size(self.state)

    def read_layer(
        self, local: tuple[str, ...], modules: dict | None = None, declarations: Declarations = NO_DECLARATIONS
    ) -> Layout | Container:
        """The parameters (and BatchNorm statistics) of the Haiku module at `local` in
        named axes (`_engine/_layouts.py`); `modules` (local path -> the `hk.Module`
        seen during a call) tells what params alone do not, e.g. an `hk.LSTM`."""
        return _haiku_layout(self.params, self.state or {}, local, modules or {}, declarations)

    def write_layer(
        self, local: tuple[str, ...], values: dict[str, Any], modules: dict | None = None,
        declarations: Declarations = NO_DECLARATIONS,
    ) -> "HaikuModule":
        """A copy with `values` (from `_layouts.fit`) in the module at `local`: new dicts
        all the way down, the user's params and state are never mutated."""
        params, state = _haiku_write(self.params, self.state or {}, local, modules or {}, values, declarations)
        new = eqx.tree_at(lambda m: m.params, self, params)
        return new.with_state(state) if self.state is not None else new

    def haiku_names(self, *args: Any, **kwargs: Any) -> dict[str, str]:
        """Dotted path -> native Haiku module name of every module called with these
        arguments (an abstract run: nothing is computed).

        **Arguments:**

        - `*args`, `**kwargs`: example arguments, as for a call.

        **Returns:**

        A dict such as `{"mlp.linear_0": "mlp/~/linear_0"}`.
        """
        names = {}

        def run(model, args, kwargs):
            transforms = _Transforms(len(hk_base.context_stack) + 1)

            def record(next_f, args, kwargs, context):
                local = transforms.local(model.methods, context)
                if local is not None:
                    names[".".join(local)] = context.module.module_name
                return transforms.run(context, next_f, args, kwargs)

            with hk.intercept_methods(record):
                return model.apply_fn(*model._apply_inputs(), *args, **kwargs)

        eqx.filter_eval_shape(run, self, args, kwargs)
        return names


def from_haiku(
    transformed: hk.Transformed | hk.TransformedWithState,
    params: PyTree,
    state: PyTree = None,
    *,
    rng: PRNGKeyArray | None = None,
    methods: Sequence[str] | None = None,
) -> HaikuModule:
    """Expose a Haiku model as an `eqx.Module` that every peex_interop hook works on.

    **Arguments:**

    - `transformed`: the result of `hk.transform`, `hk.transform_with_state` or
        `hk.without_apply_rng(...)`.
    - `params`: its params (never mutated).
    - `state`: its state, for `hk.transform_with_state`.
    - `rng`: the key passed to `apply` (models with dropout); change it per step with
        `.with_rng(key)`.
    - `methods`: the Haiku module methods whose calls are sites (`__init__` never is);
        by default `__call__` and every method site (`vq.quantize`: see "What is a
        site" in the engine docs).

    **Returns:**

    A `HaikuModule` called with the transformed function's own arguments.
    """
    if not isinstance(transformed, (hk.Transformed, hk.TransformedWithState)):
        raise TypeError(
            "from_haiku expects the result of hk.transform / hk.transform_with_state, "
            f"got {type(transformed).__name__}"
        )
    stateful = isinstance(transformed, hk.TransformedWithState)
    if stateful and state is None:
        raise TypeError("a model from hk.transform_with_state needs its `state`")
    takes_rng = "rng" in inspect.signature(transformed.apply).parameters
    return HaikuModule(
        params=params, state=state if stateful else None, rng=rng,
        apply_fn=transformed.apply, stateful=stateful, takes_rng=takes_rng,
        methods=_layer_methods(methods),
    )


# -- parameter layouts (px.transfer_params) ------------------------------------------
# Haiku's facts: `w` is (in, out) / (*window, in / groups, out); `hk.MultiHeadAttention`
# projects with `hk.Linear`s named query/key/value/linear whose outputs merge
# (heads, head_dim) head-major; `hk.LSTM` is one `linear` on concat(x, h) with gates
# (i, g, f, o) and 1 added to the forget gate; BatchNorm keeps its statistics in state
# (`<name>/~/mean_ema`, `var_ema`), shaped like its (1, ..., features) scale.
# `hk.experimental.layer_stack` puts a stack axis in front of every parameter under
# its `__layer_stack...` scope.

_ATTENTION = ("query", "key", "value", "linear")
_LSTM_GATES = ("i", "g", "f", "o")


def _param_key(params: dict, local: tuple[str, ...]) -> str | None:
    return next((key for key in params if _params_path(key) == local), None)


def _stacked(key: str) -> int:
    return sum(segment.startswith("__layer_stack") for segment in haiku_path(key))


def _is_attention(params: dict, local: tuple[str, ...], modules: dict) -> bool:
    if local[:-1] in modules:
        return isinstance(modules[local[:-1]], hk.MultiHeadAttention)
    # Without a call, the names tell: Haiku's attention always names its projections so.
    return bool(local) and local[-1] in _ATTENTION and all(
        _param_key(params, (*local[:-1], name)) is not None for name in _ATTENTION
    )


def _lstm_key(params: dict, local: tuple[str, ...]) -> str:
    key = _param_key(params, (*local, "linear"))
    if key is None:
        raise HookError(f"transfer_params: the hk.LSTM at {'.'.join(local)!r} has no parameters")
    return key


def _lstm(params: dict, local: tuple[str, ...]) -> Layout:
    key = _lstm_key(params, local)
    w, b = params[key]["w"], params[key].get("b")
    hidden = w.shape[-1] // 4
    gates = axes(("gate", "hidden"))[0]
    layout = Layout("lstm", {
        "input_kernel": Param(w[..., : w.shape[-2] - hidden, :], axes("in", gates)),
        "hidden_kernel": Param(w[..., w.shape[-2] - hidden :, :], axes("recurrent", gates)),
        "bias": Param(b, axes(gates), (("gate", "f", 1.0),)),
    }, {"hidden": hidden}, {"gate": _LSTM_GATES})
    return layout


def _transpose(params: dict, local: tuple[str, ...], module: hk.ConvNDTranspose) -> Layout:
    # Haiku runs `w` (*window, out, in) unflipped over the input dilated by the stride.
    path = ".".join(local)
    if module.output_shape is not None:
        raise refuse(path, "with output_shape= its padding depends on the input size, so no other layer's can be "
                     "checked equal")
    key = _param_key(params, local)
    if key is None:
        raise HookError(f"transfer_params: the hk.ConvNDTranspose at {path!r} has no parameters")
    w, b = params[key]["w"], params[key].get("b")
    dims = module.num_spatial_dims
    window = tuple(f"window{i}" for i in range(dims))
    padding = lax_transpose_padding(module.kernel_shape, module.stride, (1,) * dims, module.padding)
    facts = {"groups": 1, "stride": tuple(module.stride), "dilation": (1,) * dims, "padding": padding}
    bias = axes("out") if module.channel_index == -1 else axes("out", *[()] * dims)
    return Layout("conv_transpose", {"kernel": Param(w, axes(*window, "out", "in")), "bias": Param(b, bias)},
                  facts=facts)


# A conv's and a conv-transpose's params look alike (`w`, `b`); only the module, known
# from a call, or the default name of hk.Conv1D/2D/3D/ConvND (`conv2_d`, `conv2_d_1`
# for a second one) tells them apart.
_CONV_NAME = re.compile(r"(conv[123]_d|conv_nd)(_\d+)?")
_UNKNOWN_KIND = (
    "its parameters could be a conv's or a conv-transpose's (laid out differently), and its name is not a default "
    "name of hk.Conv1D/2D/3D/ConvND: pass inputs= (example inputs) so the layer kind is known"
)


def _haiku_cache(state: dict, local: tuple[str, ...]) -> Layout | None:
    """The module's own state (`hk.get_state`) as a `decode_cache` layout, or `None`
    without any. Haiku keeps no decode cache of its own: the layout of keys and values
    a module caches is its author's, so only a `cache_index` (a position) is
    transferred, and other state is refused by name."""
    key = _param_key(state, local)
    if key is None:
        return None
    held = {}
    for name, value in state[key].items():
        if name != "cache_index":
            raise refuse(
                ".".join(local),
                f"its state {name!r} {tuple(value.shape)} has no known layout: Haiku has no decode cache of its own, "
                "and the axes of one a module keeps with hk.get_state are its author's (only a cache_index "
                "is transferred)",
            )
        held[name] = Param(value, axes())
    return Layout("decode_cache", held)


def _haiku_layout(
    params: dict, state: dict, local: tuple[str, ...], modules: dict, declarations: Declarations
) -> Layout | Container:
    cache = _haiku_cache(state, local)
    below = any(_params_path(key)[: len(local)] == local for key in params)
    if cache is not None and not below:
        return Container((), cache)  # a module with state only (a position embedding)
    layout = _params_layout(params, state, local, modules, declarations)
    return layout if cache is None else dataclasses.replace(layout, state=cache)


def _params_layout(
    params: dict, state: dict, local: tuple[str, ...], modules: dict, declarations: Declarations
) -> Layout | Container:
    path = ".".join(local)
    module = modules.get(local)
    declared = _declared(params, local, modules, declarations)
    if declared is not None:
        own = params[_param_key(params, local)]
        return declared.read(lambda places: own.get(places[0]))
    if isinstance(module, hk.LSTM):
        return _lstm(params, local)
    if isinstance(module, (hk.GRU, hk.VanillaRNN)):
        raise refuse(
            path,
            f"hk.{type(module).__name__} has no exact counterpart: its gates differ from Equinox's and NNX's cells "
            "(hk.GRU applies the reset gate before the recurrent matmul)",
        )
    if isinstance(module, hk.ConvNDTranspose):
        return _transpose(params, local, module)
    key = _param_key(params, local)
    if key is None:
        parts = [
            ".".join(p[len(local):])
            for p in map(_params_path, params)
            if p[: len(local)] == local and len(p) > len(local)
        ]
        if not parts:
            raise HookError(f"transfer_params: no Haiku module with parameters at {path!r}")
        return Container(tuple(parts))
    values, lead = params[key], _stacked(key)
    names = set(values)
    if names <= {"w", "b"} and "w" in names:
        w, b = values["w"], values.get("b")
        if w.ndim - lead == 2 and _is_attention(params, local, modules):
            heads = axes(("heads", "head_dim"))[0]
            sizes = {"heads": modules[local[:-1]].num_heads} if local[:-1] in modules else {}
            if local[-1] == "linear":
                return Layout(
                    "attention_out", {"kernel": Param(w, axes(heads, "out")), "bias": Param(b, axes("out"))}, sizes
                )
            return Layout("attention_in", {"kernel": Param(w, axes("in", heads)), "bias": Param(b, axes(heads))}, sizes)
        if w.ndim - lead == 2:
            return Layout("linear", {"kernel": Param(w, axes("in", "out")), "bias": Param(b, axes("out"))})
        if module is None and not _CONV_NAME.fullmatch(local[-1]):
            raise refuse(path, _UNKNOWN_KIND)
        window = tuple(f"window{i}" for i in range(w.ndim - lead - 2))
        facts = {"groups": module.feature_group_count} if isinstance(module, hk.ConvND) else {}
        kernel = Param(w, axes(*window, "in", "out"))
        return Layout("conv", {"kernel": kernel, "bias": Param(b, axes("out"))}, facts=facts)
    if names == {"embeddings"}:
        return Layout("embedding", {"embedding": Param(values["embeddings"], axes("vocab", "features"))})
    if names <= {"scale", "offset"}:
        some = next(iter(values.values()))
        feature = axes(*[()] * (some.ndim - lead - 1), "features")
        norm = {"scale": Param(values.get("scale"), feature), "offset": Param(values.get("offset"), feature)}
        facts = {"groups": module.groups} if isinstance(module, hk.GroupNorm) else {}
        stats = {name: state.get(f"{key}/~/{name}_ema") or {} for name in ("mean", "var")}
        if all("average" in s for s in stats.values()):
            return Layout("batch_norm", {**norm, **{n: Param(s["average"], feature) for n, s in stats.items()}})
        return Layout("norm", norm, facts=facts)
    if names == {"w_i", "w_h", "b"}:
        raise refuse(
            path,
            "hk.GRU has no exact counterpart: it applies the reset gate before the recurrent matmul, Equinox's and "
            "NNX's cells after",
        )
    return as_stored(values).read(lambda places: values[places[0]])


def _declared(params: dict, local: tuple[str, ...], modules: dict, declarations: Declarations) -> Declared | None:
    """The user's declaration for the module at `local` (by path; by class too where a
    call told it), which holds parameters of its own."""
    if _param_key(params, local) is None:
        return None
    return declarations.find(modules.get(local), ".".join(local))


_NATIVE = {"kernel": "w", "bias": "b", "embedding": "embeddings", "scale": "scale", "offset": "offset"}


def _into(path: str, old: dict, new: dict) -> dict:
    # Haiku keeps no metadata beside an array: where it goes is the sharding of the
    # array (or of the abstract one) it replaces.
    return {**old, **{name: put_like(path, value, old.get(name)) for name, value in new.items()}}


def _haiku_write(
    params: dict, state: dict, local: tuple[str, ...], modules: dict, values: dict, declarations: Declarations
) -> tuple[dict, dict]:
    path = ".".join(local)
    if isinstance(modules.get(local), hk.LSTM):
        key = _lstm_key(params, local)
        kernel = jnp.concatenate([values["input_kernel"], values["hidden_kernel"]], axis=-2)
        new = {"w": kernel, **({"b": values["bias"]} if "bias" in values else {})}
        return {**params, key: _into(path, params[key], new)}, state
    new_state = dict(state)
    if "cache_index" in values:
        held = _param_key(state, local)
        assert held is not None  # _haiku_cache found it
        new_state[held] = _into(path, state[held], {"cache_index": values["cache_index"]})
    values = {name: value for name, value in values.items() if name != "cache_index"}
    if not values:
        return params, new_state
    key = _param_key(params, local)
    assert key is not None  # _haiku_layout found it
    for name in ("mean", "var"):
        if name in values:
            ema = f"{key}/~/{name}_ema"
            # Inference reads `average`; `hidden` restarts the moving average from it.
            new = {"average": values[name], "hidden": values[name]}
            if is_abstract(state[ema].get("counter")):
                # An abstract destination has no count of updates: a fresh one's is 0.
                new["counter"] = jnp.zeros(state[ema]["counter"].shape, state[ema]["counter"].dtype)
            new_state[ema] = _into(path, state[ema], new)
    declared = _declared(params, local, modules, declarations)
    if declared is not None:
        native = {declared.params[name].where[0]: value for name, value in values.items()}
    elif getattr(_params_layout(params, state, local, modules, declarations), "kind", None) == AS_STORED:
        native = values  # read as stored, by Haiku's own names
    else:
        native = {_NATIVE[name]: value for name, value in values.items() if name in _NATIVE}
    return {**params, key: _into(path, params[key], native)}, new_state
