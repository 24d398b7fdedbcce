"""How a layer says where its parameters are and what their axes mean: one mechanism for
the libraries' built-in layers and a user's own (`px.declare`, `px.at`).

A `Declared` is a layer's layout kind (`_layouts.LAYOUT_KINDS`, or a kind of the user's
own), and for each library-neutral parameter name the place it is stored in the layer
(`StoredParam.where`: an attribute path, a variable name, a params key: each adapter
reads it the way its library stores arrays) with its named axes. Each adapter's table
of built-in layers is made of `Declared`s, and a user's declarations (`layouts=` of
`px.align`, `px.transfer_params`, `px.port`), keyed by class or by path pattern, come
first: a user's `Einsum` is declared exactly as the libraries' `Linear` is.

An atom listed in `members` has named members (gates, or the `k`/`v` of a fused key-value
projection): one layer whose parameter has such an axis corresponds to several layers of
the other model, one per member, split or merged along it (`_layouts.split`).

A layer of no known layout is read *as stored* (`as_stored`): every array it holds by
its own name, each axis an atom of its own. Two such layers port exactly when they hold
the same names and shapes (two instances of one class), and are refused otherwise.
"""

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from .._errors import HookError
from ._layouts import AS_STORED, LAYOUT_KINDS, Axes, Layout, Param, axes
from ._selection import glob_to_regex


@dataclasses.dataclass(frozen=True)
class StoredParam:
    """Where a layer stores one parameter (`where`: one place, or several stacked along
    the parameter's second-to-last axis, as NNX's per-gate kernels), and the named axes
    of the value. Build it with `px.at`."""

    where: tuple[str, ...]
    axes: Axes
    # The layer computes with the stored value plus `offset` (Gemma's RMSNorm scales by
    # `1 + scale`): a transfer carries the value used.
    offset: float = 0.0
    # As `_layouts.Param`'s: constants added to members, atoms stored reversed.
    shift: tuple[tuple[str, str, float], ...] = ()
    flipped: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Declared:
    """A layer's parameters: its layout kind, and each parameter's place and named axes.
    Build it with `px.declare`."""

    kind: str
    params: Mapping[str, StoredParam]
    members: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    sizes: Mapping[str, int] = dataclasses.field(default_factory=dict)
    facts: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def read(self, value_at: Callable[[tuple[str, ...]], Any], state: Layout | None = None) -> Layout:
        """The layer's `Layout`, each value read by the adapter's `value_at(where)`
        (`None` where the layer has none: a bias it was built without)."""
        params = {
            name: Param(value_at(p.where) if p.where else None, p.axes, p.shift, p.flipped, p.offset)
            for name, p in self.params.items()
        }
        return Layout(self.kind, params, dict(self.sizes), dict(self.members), dict(self.facts), state)

    def places(self) -> set[str]:
        """Every place the declaration reads."""
        return {where for p in self.params.values() for where in p.where}


def at(where: str | tuple[str, ...], *entries: str | tuple[str, ...], offset: float = 0.0) -> StoredParam:
    """Where a layer stores a parameter and the names of its axes.

    **Arguments:**

    - `where`: the parameter's place in the layer: an attribute path for Equinox and NNX
        (`"w"`, `"kernel"`, `"attn.w"`), a variable name for linen (`"kernel"`; another
        collection than `params` as `"batch_stats:mean"`), a params key for Haiku and
        function models (`"w"`).
    - `*entries`: one per axis of the stored array, last axes last: an axis name, or a
        tuple of names for one axis merging several, major first (`("heads",
        "head_dim")`); `()` for a broadcast axis of size 1. Axes in front of these are
        a stack of layers (a scanned stack) and must match the other side's exactly.
    - `offset`: the layer computes with the stored value plus this (an RMSNorm
        computing `x * (1 + scale)` stores `scale` with `offset=1.0`).

    **Returns:**

    A `px.StoredParam`, a value of `px.declare`.
    """
    return StoredParam((where,) if isinstance(where, str) else tuple(where), axes(*entries), offset)


def declare(
    kind: str,
    /,
    *,
    members: Mapping[str, tuple[str, ...]] | None = None,
    sizes: Mapping[str, int] | None = None,
    facts: Mapping[str, Any] | None = None,
    **params: StoredParam,
) -> Declared:
    """Declare the layout of a layer's parameters: what `px.transfer_params` and
    `px.port` convert by named axes, exactly or not at all.

    **Arguments:**

    - `kind`: the layout kind (`"linear"`, `"attention_in"`, `"attention_out"`,
        `"conv"`, `"embedding"`, `"norm"`, ...: the table of docs/migrating.md), whose
        parameter names and axis names the declaration uses; or a kind of your own, which
        only a layer declared with the same kind and parameter names matches.
    - `members`: axes whose entries are named members, `{"kv": ("k", "v")}`: a fused
        layer whose parameter has such an axis corresponds to one layer per member in
        the other model (map it to a tuple of paths, in member order).
    - `sizes`: axis sizes the arrays do not tell (`{"heads": 8}` where a kernel merges
        heads and head_dim, and the other side does not tell either).
    - `facts`: settings both sides must share (`{"eps": 1e-6}`).
    - `**params`: each parameter by its library-neutral name: `px.at(...)`.

    **Returns:**

    A `px.Declared`, the value of a `layouts=` entry (or what a function given there
    returns for one layer).
    """
    for name, param in params.items():
        if not isinstance(param, StoredParam):
            raise TypeError(f"px.declare({kind!r}): {name}= takes px.at(...), got {type(param).__name__}")
    return Declared(kind, dict(params), dict(members or {}), dict(sizes or {}), dict(facts or {}))


Declaration = Declared | Callable[[Any], "Declared | None"]


def _atoms(entries: Axes) -> list[str]:
    return [atom for entry in entries for atom in entry]


def check(declared: Declared, path: str) -> Declared:
    """`declared` if it uses its kind's parameter and axis names (atoms with named members
    besides), else an error naming the layer, expected and got."""
    if not isinstance(declared, Declared):
        raise HookError(
            f"layouts=: the declaration for layer {path!r} returned {type(declared).__name__}, not px.declare(...)"
        )
    expected = LAYOUT_KINDS.get(declared.kind)
    if expected is None:
        return declared
    unknown = sorted(set(declared.params) - set(expected))
    if unknown:
        raise HookError(
            f"layouts=: layer {path!r} is declared a {declared.kind} layer with parameters {unknown}; a "
            f"{declared.kind} layer's are {list(expected)}"
        )
    for name, param in declared.params.items():
        atoms = {"window" if a.startswith("window") else a for a in _atoms(param.axes)} - set(declared.members)
        if atoms != set(expected[name]):
            raise HookError(
                f"layouts=: layer {path!r}: {name} is declared with axes {sorted(atoms)}; a {declared.kind} "
                f"layer's {name} has axes {list(expected[name])} (and axes named in members=)"
            )
    return declared


@dataclasses.dataclass(frozen=True)
class Declarations:
    """A user's `layouts=`: class or path pattern -> `Declared`, or a function of the
    layer returning one (or `None`: the built-in layout). Paths are the model's, for a
    converted model inside another at `prefix`."""

    table: Mapping[Any, Declaration] = dataclasses.field(default_factory=dict)
    prefix: str = ""

    @classmethod
    def of(cls, layouts: "Mapping[Any, Declaration] | Declarations | None") -> "Declarations":
        if isinstance(layouts, Declarations):
            return layouts
        if layouts is None:
            return cls()
        if not isinstance(layouts, Mapping):
            raise TypeError(f"layouts= takes a dict {{class or path pattern: px.declare(...)}}, got {layouts!r}")
        for key, value in layouts.items():
            if not isinstance(key, (str, type)):
                raise TypeError(f"layouts=: a key is a layer class or a path pattern, got {key!r}")
            if not (isinstance(value, Declared) or callable(value)):
                raise TypeError(f"layouts=: {key!r} maps to {value!r}: give px.declare(...) or a function of the layer")
        return cls(dict(layouts))

    def under(self, prefix: str) -> "Declarations":
        """These declarations for a converted model at `prefix` inside the model."""
        joined = ".".join(p for p in (self.prefix, prefix) if p)
        return dataclasses.replace(self, prefix=joined)

    def find(self, layer: Any, path: str) -> Declared | None:
        """The user's declaration for the layer (the library's module, or `None` where
        the adapter has none) at `path` (local to the converted model): path patterns in
        the order given, then the most derived class."""
        if not self.table:
            return None
        full = ".".join(p for p in (self.prefix, path) if p)
        for key, value in self.table.items():
            if isinstance(key, str) and glob_to_regex(key).match(full):
                found = self._resolved(value, layer, full)
                if found is not None:
                    return found
        if layer is None:
            return None
        for base in (layer if isinstance(layer, type) else type(layer)).__mro__:
            if base in self.table:
                found = self._resolved(self.table[base], layer, full)
                if found is not None:
                    return found
        return None

    @staticmethod
    def _resolved(value: Declaration, layer: Any, path: str) -> Declared | None:
        declared = value if isinstance(value, Declared) else value(layer)
        return None if declared is None else check(declared, path)


def as_stored(arrays: Mapping[str, Any], names: Mapping[str, tuple[str, ...]] | None = None) -> Declared:
    """The layout of a layer of no known layout: each array (`place -> value`) a
    parameter of its own name, each of its axes an atom of its own (`w[0]`, `w[1]`):
    exact between layers holding the same names and shapes, refused otherwise."""
    params = {}
    for place, value in arrays.items():
        entries = tuple(f"{place}[{i}]" for i in range(len(value.shape)))
        params[place] = StoredParam((names or {}).get(place, (place,)), axes(*entries))
    return Declared(AS_STORED, params)


# No declarations: every layer read by its library's layouts, else as stored.
NO_DECLARATIONS = Declarations()
