"""What the forward and backward hook wrappers share: selection and validation."""

from collections.abc import Sequence
from typing import Any

import equinox as eqx

from .._engine import (
    AbstractConverted,
    AbstractTransparent,
    Criterion,
    Selection,
    Where,
    check_model,
    inner_site_names,
    known_method_paths,
    known_module_paths,
    needs_indices,
    walk,
)


class AbstractHookWrapper(AbstractTransparent):
    """Base of `ForwardHook` and `BackwardHook`: a model plus which layers to hook."""

    layer_names: tuple[str, ...] | None = eqx.field(static=True)
    where: tuple[Criterion, ...] | None = eqx.field(static=True)
    renames: tuple[tuple[str, str], ...] = eqx.field(static=True)

    @property
    def selection(self) -> Selection:
        return Selection(self.layer_names, self.where, self.renames)

    def _user_functions(self) -> tuple:
        names = ("hook_fn", "log_fn", "pre_hook_fn", "pre_log_fn")
        return tuple(fn for fn in (getattr(self, name, None) for name in names) if fn is not None)

    @property
    def explicit_patterns(self) -> tuple[str, ...]:
        """The patterns of `{pattern: hook}` / `{pattern: log}` maps given as hooks or
        logs: each must select a call (`_closed_world.check_reached`)."""
        return tuple(p for fn in self._user_functions() for p in getattr(fn, "patterns", ()))

    @property
    def needs_indices(self) -> bool:
        """Whether the engine must give mapped bodies' traced indices to the hooks."""
        return any(needs_indices(fn) for fn in self._user_functions())

    @property
    def needs_axis_names(self) -> bool:
        """Whether a log pools over the model's own vmaps by their axis names."""
        return any(getattr(fn, "needs_axis_names", False) for fn in self._user_functions())


def selection_fields(
    model: Any,
    wrapper: str,
    layer_names: Sequence[str] | None,
    where: Where,
    rename: dict[str, str] | None,
) -> Selection:
    """Check the model and the selection once, at construction, and normalise both to
    hashable tuples (they are static fields)."""
    check_model(model, wrapper)
    selection = Selection.make(layer_names, where, rename)
    modules = known_module_paths(model)
    if modules is not None:
        sows = any(isinstance(node, AbstractConverted) and node.sows for _, node in walk(model))
        selection.validate(
            modules, type(model).__name__, inner_site_names(model), known_method_paths(model), sows
        )
    return selection
