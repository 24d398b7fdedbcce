"""The Haiku adapter: where a Haiku module call becomes a call site.

`from_haiku` wraps `(transformed, params, state)` as an `eqx.Module`. While a hooking
context is active, its call runs `apply` inside `hk.intercept_methods`, and the
interceptor hands every selected method call of every Haiku submodule to
`_context.call_site`, with the Haiku module name turned into a dotted local path.
"""

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import haiku as hk
import jax
from jaxtyping import PRNGKeyArray, PyTree

from .._engine import _context
from .._engine._errors import HookError
from .._engine._kinds import kind_of
from .._engine._paths import AbstractConverted
from .._migration._transfer import canonical_params, fitted_params

# Haiku parameter names -> px.transfer_params' canonical names (Haiku's `w` is already
# (in, out) / (*window, in, out)).
_CANONICAL = {"w": "kernel", "b": "bias", "scale": "scale", "offset": "offset", "embeddings": "embedding"}

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


def _layer_methods(methods: Sequence[str]) -> tuple[str, ...]:
    # A constructor call is not a layer call (and its module has no name yet).
    return tuple(method for method in methods if method != "__init__")


def _params_path(key: str) -> tuple[str, ...]:
    # Params of modules inside `layer_stack` sit under Haiku's internal scope
    # (`__layer_stack_no_per_layer/lin`) while the module itself is called as `lin`.
    return tuple(segment for segment in haiku_path(key) if not segment.startswith("__"))


def _is_internal(module_name: str) -> bool:
    # Haiku's own plumbing (e.g. layer_stack's `__layer_stack_no_per_layer`, whose call
    # returns params) is not a layer of the user's model.
    return _params_path(module_name) != haiku_path(module_name)


class _AbstractHaiku(AbstractConverted):
    """Routes Haiku method calls made during `run` to the engine's call sites."""

    methods: eqx.AbstractVar[tuple[str, ...]]

    def _intercepted(self, run: Callable[[], Any]) -> Any:
        if not _context.active():
            return run()
        with hk.intercept_methods(self._intercept):
            return run()

    def _intercept(self, next_f, args, kwargs, context):
        # Interceptors also see `__init__` (module_name not yet set), every public
        # method, and Haiku's internal modules: only selected methods of user modules
        # are layer calls.
        if context.method_name not in self.methods or _is_internal(context.module.module_name):
            return next_f(*args, **kwargs)
        local = haiku_path(context.module.module_name)
        if context.method_name != "__call__":
            local = (*local, context.method_name)
        return _context.call_site(self, next_f, args, kwargs, local=local, module=context.module)

    def layer_kind(self, module: hk.Module) -> str:
        return kind_of(module, HAIKU_KINDS)

    def layer_parameter_counts(self, module: hk.Module) -> tuple[int, int]:
        # Haiku keeps non-trained values (BatchNorm's moving averages) in state.
        return _size(module.params_dict()), _size(module.state_dict())


class HaikuFunction(_AbstractHaiku):
    """A function that creates and calls Haiku modules, run *inside* the user's own
    `hk.transform`: wrap it with a hook wrapper there to hook its modules."""

    fn: Callable
    methods: tuple[str, ...] = eqx.field(static=True)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._intercepted(lambda: self.fn(*args, **kwargs))

    def layers(self) -> None:
        return None  # the modules are created by the call itself

    def parameter_counts(self) -> tuple[int, int]:
        raise TypeError(
            "a HaikuFunction's parameters live in the enclosing hk.transform: count them "
            "on its params, or convert the model with px.from_haiku"
        )


def haiku_function(fn: Callable, *, methods: Sequence[str] = ("__call__",)) -> HaikuFunction:
    """Make `fn` hookable inside your own `hk.transform`ed function.

    **Arguments:**

    - `fn`: a function that builds and calls Haiku modules.
    - `methods`: the Haiku module methods that are layer calls.

    **Returns:**

    A `HaikuFunction` to pass to `px.ForwardHook` inside the transformed function;
    return the log from the transformed function to get it out.
    """
    return HaikuFunction(fn, _layer_methods(methods))


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
    methods: tuple[str, ...] = eqx.field(static=True)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._intercepted(lambda: self.apply_fn(*self._apply_inputs(), *args, **kwargs))

    def _apply_inputs(self) -> tuple:
        inputs = (self.params, self.state) if self.stateful else (self.params,)
        return (*inputs, self.rng) if self.takes_rng else inputs

    def with_state(self, state: PyTree) -> "HaikuModule":
        """The same model carrying `state` (e.g. the `new_state` a call returned)."""
        return eqx.tree_at(lambda m: m.state, self, state, is_leaf=lambda x: x is None)

    def with_rng(self, rng: PRNGKeyArray | None) -> "HaikuModule":
        """The same model using `rng` for its next calls (dropout, sampling)."""
        return eqx.tree_at(lambda m: m.rng, self, rng, is_leaf=lambda x: x is None)

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

    def _param_key(self, local: tuple[str, ...]) -> str:
        for key in self.params:
            if _params_path(key) == local:
                return key
        raise HookError(f"no Haiku module with parameters at {'.'.join(local)!r}")

    def read_layer(self, local: tuple[str, ...]) -> dict[str, Any]:
        key = self._param_key(local)
        return canonical_params(".".join(local), dict(self.params[key]), _CANONICAL)

    def write_layer(self, local: tuple[str, ...], params: dict[str, Any]) -> "HaikuModule":
        key = self._param_key(local)
        targets = self.read_layer(local)
        fitted = fitted_params(".".join(local), params, targets)
        native = {name: fitted[canonical] for name, canonical in _CANONICAL.items() if canonical in fitted}
        # New dicts all the way down: the user's params are never mutated.
        return eqx.tree_at(lambda m: m.params, self, {**self.params, key: native})

    def haiku_names(self, *args: Any, **kwargs: Any) -> dict[str, str]:
        """Dotted path -> native Haiku module name of every module called with these
        arguments (an abstract run: nothing is computed).

        **Arguments:**

        - `*args`, `**kwargs`: example arguments, as for a call.

        **Returns:**

        A dict such as `{"mlp.linear_0": "mlp/~/linear_0"}`.
        """
        names = {}

        def record(next_f, args, kwargs, context):
            if context.method_name in self.methods and not _is_internal(context.module.module_name):
                local = haiku_path(context.module.module_name)
                names[".".join(local)] = context.module.module_name
            return next_f(*args, **kwargs)

        def run(model, args, kwargs):
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
    methods: Sequence[str] = ("__call__",),
) -> HaikuModule:
    """Expose a Haiku model as an `eqx.Module` that every peex_interop hook works on.

    **Arguments:**

    - `transformed`: the result of `hk.transform`, `hk.transform_with_state` or
        `hk.without_apply_rng(...)`.
    - `params`: its params (never mutated).
    - `state`: its state, for `hk.transform_with_state`.
    - `rng`: the key passed to `apply` (models with dropout); change it per step with
        `.with_rng(key)`.
    - `methods`: the Haiku module methods that are layer calls (`__init__` never is).

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
