"""Per-step updates of converted models (`with_state`, `with_rng`, `with_variables`,
`with_rngs`): a training or RL loop makes one every step, outside `jit`."""

from typing import Any

import equinox as eqx


def replace[M: eqx.Module](module: M, **fields: Any) -> M:
    """A copy of `module` with `fields` replaced, built the way Equinox's unflatten
    builds a module (no `__init__`, no checks run again): about a microsecond, where
    `eqx.tree_at` flattens and rebuilds the whole model (tens of µs per step)."""
    new = object.__new__(type(module))
    vars(new).update(vars(module), **fields)
    return new
