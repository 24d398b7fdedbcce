"""`HaikuFunction`: a function of Haiku modules hooked inside the user's own
`hk.transform`; `haiku_function` builds it."""

from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx

from ..._engine import NO_DECLARATIONS, Declarations, Layout
from ._interception import AbstractHaiku, layer_methods


class HaikuFunction(AbstractHaiku):
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
    return HaikuFunction(fn=fn, methods=layer_methods(methods))
