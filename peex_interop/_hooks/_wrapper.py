"""What the forward and backward hook wrappers share: selection and validation."""

from collections.abc import Sequence
from typing import Any

import equinox as eqx

from .._engine._hooking import check_model
from .._engine._paths import AbstractTransparent, module_paths, paths_known
from .._engine._selection import Criterion, Selection, Where


class AbstractHookWrapper(AbstractTransparent):
    """Base of `ForwardHook` and `BackwardHook`: a model plus which layers to hook."""

    layer_names: tuple[str, ...] | None = eqx.field(static=True)
    where: tuple[Criterion, ...] | None = eqx.field(static=True)
    renames: tuple[tuple[str, str], ...] = eqx.field(static=True)

    @property
    def selection(self) -> Selection:
        return Selection(self.layer_names, self.where, self.renames)


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
    if paths_known(model):
        selection.validate(module_paths(model), type(model).__name__)
    return selection
