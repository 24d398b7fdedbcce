"""`HaikuModule`: a Haiku transformed function with its params (and state) as one
`eqx.Module`; `from_haiku` builds it."""

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import haiku as hk
from haiku._src import base as hk_base  # the frames: Haiku's per-transform Python state
from jaxtyping import PRNGKeyArray, PyTree

from ..._engine import NO_DECLARATIONS, Container, Declarations, Layout
from ..._errors import HookError
from .._replace import replace
from ._interception import AbstractHaiku, layer_methods, total_size
from ._layouts import haiku_layout, haiku_write
from ._names import params_path
from ._transforms import Transforms


class HaikuModule(AbstractHaiku):
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
            path = params_path(name)
            for end in range(1, len(path) + 1):
                paths[path[:end]] = None
        return paths

    def parameter_counts(self) -> tuple[int, int]:
        return total_size(self.params), total_size(self.state)

    def read_layer(
        self, local: tuple[str, ...], modules: dict | None = None, declarations: Declarations = NO_DECLARATIONS
    ) -> Layout | Container:
        """The parameters (and BatchNorm statistics) of the Haiku module at `local` in
        named axes (`_engine/_layouts.py`); `modules` (local path -> the `hk.Module`
        seen during a call) tells what params alone do not, e.g. an `hk.LSTM`."""
        return haiku_layout(self.params, self.state or {}, local, modules or {}, declarations)

    def write_layer(
        self, local: tuple[str, ...], values: dict[str, Any], modules: dict | None = None,
        declarations: Declarations = NO_DECLARATIONS,
    ) -> "HaikuModule":
        """A copy with `values` (from `_layouts.fit`) in the module at `local`: new dicts
        all the way down, the user's params and state are never mutated."""
        params, state = haiku_write(self.params, self.state or {}, local, modules or {}, values, declarations)
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
            transforms = Transforms(len(hk_base.context_stack) + 1)

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
        methods=layer_methods(methods),
    )
