"""Call sites as hooks see them: the values that describe one layer call.

`Site` is what a policy runs (`HookContext.run` builds it); `CallSite` is the pytree a
hook or log that takes a second argument receives; `Frame` is a call running in a
context; `InnerCall` stands for the module of a site inside a layer. Whether a user's
hook takes the call site at all is decided here too (`takes_site`).
"""

import dataclasses
import functools
import inspect
from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax.numpy as jnp

from ._selection import glob_to_regex, step_path, step_segments, steps_of


@dataclasses.dataclass(frozen=True)
class Site:
    """One selected call of one layer, as a policy sees it.

    `indices`/`lengths`: the traced index and the size of every threaded mapped body
    (vmap, scan, map, static fori_loop) the call runs in, outermost first. `stacks`:
    which of those bodies map the model's own arrays (a scanned stack of layers), each
    with the path of the layer the stack's step index follows (`blocks` in
    `blocks.1.attn`). `active`: for a call selected at some steps only (`where=
    "blocks.1.attn"`), the traced condition under which hooks apply.
    """

    path: str
    key: str
    owner: Any
    module: Any
    kind: str
    call: Callable[..., Any]
    args: tuple
    kwargs: dict
    call_index: int = 0
    indices: tuple = ()
    lengths: tuple[int, ...] = ()
    stacks: tuple[tuple[int, str], ...] = ()
    active: Any = None
    # Whether the log key is one step's (`blocks.1.attn`): its stacks' axes are sliced.
    one_step: bool = False
    # The function whose parameters `args` and `kwargs` fill (a peex-style pre-hook
    # binds them: `_arguments.py`).
    signature: Callable[..., Any] | None = None

    @property
    def log_index(self) -> tuple:
        """This call's index into its log entry (the mapped axes the entry keeps)."""
        sliced = {level for level, _ in self.stacks} if self.one_step else set()
        return tuple(index for level, index in enumerate(self.indices) if level not in sliced)

    @property
    def step_path(self) -> str:
        """The path with each stack's step index after its root: `blocks.{i}.attn`
        (`{i}` a placeholder: steps are traced)."""
        return step_path(self.path, [root for _, root in self.stacks], ["{i}"] * len(self.stacks))


@dataclasses.dataclass(frozen=True, eq=False)
class InnerCall:
    """The `module` of a site inside a layer (`_inner_sites.py`): what `CallSite.
    module_type` names and `px.sites` lists for it. `layer` is the library module of
    the layer it runs in, `name` the site's last path segment, `kind` its kind."""

    layer: Any
    name: str
    kind: str


class Frame(NamedTuple):
    """A call site running in a context (`HookContext.frames`, innermost last)."""

    owner: Any
    local: tuple[str, ...]
    path: str
    # How many scopes were open when the call began (the stacks it runs in).
    depth: int
    module: Any
    kind: str
    # The path of the layer the call belongs to: its own, or, for a method site
    # (`embedder.attend`), its module's (`embedder`). Sites inside the call are named
    # under it, and a stack's step index follows it.
    layer: str
    # The functions by which this call formed attention weights (`_routes.py`): a
    # second one makes its `.weights` ambiguous.
    weights_formed: list[str]


class CallSite(eqx.Module):
    """Where a hook or log runs: given to any hook or log that takes a second argument
    (`def hook(value, site): ...`).

    - `path`: the layer's dotted path (`"blocks.attn"`; a stack's layers share one).
    - `key`: its log key (`"blocks.attn@1"` for a second call, `"blocks.1.attn"` for
      one selected step).
    - `kind`: its library-independent kind (`px.KINDS`); `module_type`: the library's
      class (`eqx.nn.Linear`, `hk.Linear`, `nnx.Linear`, ...), `px.InnerCall` for a
      site inside a layer (`attn.weights`, `mlp.gelu`).
    - `call_index`: 0 for the layer's first call in this forward pass, 1 for the next...
    - `indices`, `lengths`: inside threaded `vmap`/`scan`/`map`/`fori_loop` bodies, the
      traced index (int32 scalar) and the size of each, outermost first (`()` outside).
    - `log_index`: this call's index into its log entry: `log[site.key][site.log_index]`
      is this call's value (the entry is stacked along the mapped axes it runs in).
    - `steps`, `stack_roots`, `stack_lengths`: inside scanned (or vmapped) stacks of
      layers, the traced index of this layer in each stack, the path each step
      follows (`blocks` for `blocks.1.attn`) and each stack's size, outermost first.
      `step` and `stack_root` are the innermost stack's (`None` outside a stack).
      `stack_levels`: the level in `indices` of each stack (which mapped axes of a log
      entry are steps of a stack, for what splits a value by steps: `px.patch_sweep`).
    """

    # A pytree (an `eqx.Module`): the traced indices are its leaves, so it can be
    # passed through `jax.custom_vjp` to backward hooks; the rest is static.
    path: str = eqx.field(static=True)
    key: str = eqx.field(static=True)
    kind: str = eqx.field(static=True)
    module_type: type = eqx.field(static=True)
    call_index: int = eqx.field(static=True)
    indices: tuple
    lengths: tuple[int, ...] = eqx.field(static=True)
    log_index: tuple
    steps: tuple
    stack_roots: tuple[str, ...] = eqx.field(static=True)
    stack_lengths: tuple[int, ...] = eqx.field(static=True)
    stack_levels: tuple[int, ...] = eqx.field(static=True)

    @classmethod
    def of(cls, site: "Site") -> "CallSite":
        return cls(
            site.path, site.key, site.kind, type(site.module), site.call_index, site.indices, site.lengths,
            site.log_index,
            tuple(site.indices[level] for level, _ in site.stacks),
            tuple(root for _, root in site.stacks),
            tuple(site.lengths[level] for level, _ in site.stacks),
            tuple(level for level, _ in site.stacks),
        )

    @property
    def step(self) -> Any:
        return self.steps[-1] if self.steps else None

    @property
    def stack_root(self) -> str | None:
        return self.stack_roots[-1] if self.stack_roots else None

    def matches(self, pattern: str) -> Any:
        """Whether `pattern` (a glob as in `where=`) names this call: `True`/`False`, or,
        for one step of a stack (`"blocks.1.attn"`), a traced boolean."""
        if glob_to_regex(pattern).match(self.path) or glob_to_regex(pattern).match(self.key):
            return True
        found = steps_of(pattern, step_segments(self.path, self.stack_roots), self.stack_lengths)
        if not found:
            return False
        condition = jnp.asarray(True)
        for level, step in found[0].items():
            condition = condition & (self.steps[level] == step)
        return condition


def _takes_site(fn: Callable) -> bool:
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    # A second parameter with a default is an option (`jnp.max(a, axis=None)`), unless
    # it is called `site`.
    return len(positional) >= 2 and (positional[1].default is inspect.Parameter.empty or positional[1].name == "site")


@functools.cache
def _takes_site_by_type(cls: type) -> bool:
    return _takes_site(functools.partial(cls.__call__, None))  # without `self`


def takes_site(fn: Any) -> bool:
    """Whether a user hook or log takes the call site as a second positional argument
    (`hook(value, site)`); peex's one-argument form does not. A callable may say so
    itself with a `takes_site` attribute (`px.FunctionHook` does, for the function it
    wraps)."""
    declared = getattr(fn, "takes_site", None)
    if isinstance(declared, bool):
        return declared
    if isinstance(fn, eqx.Module):
        return _takes_site_by_type(type(fn))
    return _takes_site(fn)


def needs_indices(fn: Any) -> bool:
    """Whether a user hook or log reads traced indices of the call site (it takes the
    site, unless it says otherwise with a `needs_indices` attribute)."""
    declared = getattr(fn, "needs_indices", None)
    return declared if isinstance(declared, bool) else takes_site(fn)


def call_with_site(fn: Any, value: Any, site: CallSite) -> Any:
    """`fn(value, site)` for a hook or log that takes the call site, `fn(value)`
    otherwise."""
    return fn(value, site) if takes_site(fn) else fn(value)

