"""`px.sites`: every call site a hook can select, found by one abstract run of the model
through the engine (`jax.eval_shape`: shapes and dtypes only, nothing is computed)."""

import dataclasses
import math
from typing import Any

import equinox as eqx
import jax
import jax.tree_util as jtu
from equinox.nn._stateful import _Sentinel  # pyright: ignore[reportPrivateImportUsage]

from .._adapters import is_state, states_in
from .._engine import (
    EVERY_SITE,
    MEMBERS,
    AbstractConverted,
    HookContext,
    InnerCall,
    Selection,
    Site,
    check_model,
    float_size,
    hooking,
    join,
    key_name,
)
from .._errors import HookError, outside_its_vmap, run_on_a_batch


def parameter_counts(
    tree: Any, state: eqx.nn.State | None = None, caller: str = "px.total_params", at: str = ""
) -> tuple[int, int]:
    """(trainable, non-trainable) numbers of parameters of a pytree of Equinox modules
    and converted models. The values of its Equinox stateful layers (a BatchNorm's
    running statistics) are read from `state`, else from an `eqx.nn.State` inside
    `tree`, else from the layers, which hold them until `eqx.nn.make_with_state` moves
    them into a State (then refused, in the name of `caller`, naming the layer by its
    path inside `tree`, which is at `at`)."""
    # Equinox keeps running statistics (BatchNorm) as the values of StateIndex fields:
    # they are not trained, so they are counted apart; a State's own leaves are those
    # values again (a model holding its State), counted through their StateIndex.
    is_leaf = lambda x: isinstance(x, (eqx.nn.StateIndex, AbstractConverted, eqx.nn.State))  # noqa: E731
    leaves = jtu.tree_leaves_with_path(tree, is_leaf=is_leaf)
    if state is None:
        state = next((leaf for _, leaf in leaves if is_state(leaf)), None)
    trainable = other = 0
    for path, leaf in leaves:
        if isinstance(leaf, AbstractConverted):
            t, o = leaf.parameter_counts()
            trainable, other = trainable + t, other + o
        elif isinstance(leaf, eqx.nn.StateIndex):
            values = _state_values(leaf, join(at, *(key_name(key) for key in path)), state, caller)
            other += float_size(values)
        elif not is_state(leaf):
            trainable += float_size(leaf)
    return trainable, other


def _state_values(index: eqx.nn.StateIndex, where: str, state: eqx.nn.State | None, caller: str) -> Any:
    if state is not None:
        try:
            return state.get(index)
        except KeyError:
            pass  # a State of another model: the layer's own values, if it has them
    if isinstance(index.init, _Sentinel):
        given = "the eqx.nn.State given does not hold it" if state is not None else "none was given"
        raise HookError(
            f"{caller}: the eqx.nn.StateIndex at {where!r} (a stateful layer's values, e.g. running "
            "statistics) keeps its values in an eqx.nn.State, as eqx.nn.make_with_state builds it, "
            f"and {given}: pass the model's State (px.total_params(model, state); px.summary takes "
            "it among the model's arguments)"
        )
    return index.init


def state_among(tree: Any) -> eqx.nn.State | None:
    """The first `eqx.nn.State` in `tree` (a call's arguments, a model)."""
    return next(iter(states_in(tree)), None)


def _shapes(tree: Any) -> Any:
    # Tracers of the abstract run must not outlive it: arrays become their shape and
    # dtype; other leaves (None, flags, static numbers) are kept as they were passed.
    return jtu.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if eqx.is_array(x) else x, tree)


def _array_shapes(tree: Any) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(leaf.shape) for leaf in jtu.tree_leaves(tree) if isinstance(leaf, jax.ShapeDtypeStruct))


@dataclasses.dataclass(frozen=True)
class SiteRow:
    """One call of one layer, as `px.sites` finds it (and `px.summary` shows it).

    Shapes are those of one call: inside a mapped body (`vmap`, `scan`, `lax.map`,
    `fori_loop`, `shard_map`), one example or step. A log of this call
    (`px.ForwardHook(..., log_fn=px.IdentityLog())`) has the enclosing bodies' `lengths`
    in front: `lengths + shape` for each output array.

    **Fields:**

    - `key`: the log key: the path, or `path@n` for the layer's `n`-th repeated call.
    - `path`: the layer's dotted path (what `where=` matches).
    - `kind`: its kind (`px.KINDS`).
    - `module_type`: the class name of the library's module (`Linear`, `Dense`, ...);
        for a site inside a layer (`inner=True`), `InnerCall`.
    - `args`, `kwargs`: the call's arguments, arrays as `jax.ShapeDtypeStruct`.
    - `output`: the call's output, arrays as `jax.ShapeDtypeStruct`.
    - `trainable`, `non_trainable`: parameters of the layer, submodules included; of
        one layer of a stack. A method site (`embedder.attend`) shows its layer's only
        where the layer has no row of its own (on its first method's row); a site
        inside a layer, none.
    - `call`: which call of the layer this is (0 for the first; `n` in `path@n`).
    - `calls`: how many times the layer is called in one run of the model.
    - `lengths`: sizes of the mapped bodies enclosing the call, outermost first.
    - `stacks`: the indices in `lengths` of the bodies that the layer's parameters are
        stacked along (a scanned stack of layers; a stack inside a stack), `()` if none.
    - `step_path`: the path with `{i}` after each stack's root (`blocks.{i}.attn`):
        `where=` with a step number in its place selects that step only; the path
        itself outside stacks.
    - `hookable`: `False` if the call runs under a transform that peex_interop does not
        thread (a `while_loop`; a `fori_loop` with traced bounds, as under `jax.jit`):
        hooking or logging it raises `px.TransformError`.
    """

    key: str
    path: str
    kind: str
    module_type: str
    args: tuple
    kwargs: dict
    output: Any
    trainable: int
    non_trainable: int
    call: int
    calls: int
    lengths: tuple[int, ...]
    stacks: tuple[int, ...]
    step_path: str
    hookable: bool

    @property
    def stack_length(self) -> int:
        """The number of layers in the stack(s) this layer belongs to (1 if none): the
        `N` of the summary's `xN`."""
        return math.prod(self.lengths[level] for level in self.stacks)

    @property
    def input_shapes(self) -> tuple[tuple[int, ...], ...]:
        """Shapes of the array arguments, positional then keyword."""
        return _array_shapes((self.args, self.kwargs))

    @property
    def output_shapes(self) -> tuple[tuple[int, ...], ...]:
        """Shapes of the output arrays."""
        return _array_shapes(self.output)


class _SiteFinder:
    """A policy that records the static facts of every call site, as `SiteRow` fields
    but `calls` (known at the end). Facts are recorded by key: a body that JAX traces
    twice gives the same keys again."""

    observes_values = False  # shapes, types and counts only: fine under any transform

    def __init__(self, caller: str, inner: bool = False):
        self.caller = caller
        self.found: dict[str, dict[str, Any]] = {}
        # Sites inside layers are selected where a selection names them: by kind.
        self.selection = Selection(where=EVERY_SITE) if inner else Selection()

    def run_site(self, context: HookContext, site: Site) -> Any:
        # Read before the call: a layer that updates an `eqx.nn.State` invalidates the
        # one it was given.
        args, kwargs = _shapes(site.args), _shapes(site.kwargs)
        # A site inside a layer holds no parameters; a method site's are its layer's,
        # counted where the layer's own call is (`find_sites`).
        holds_none = isinstance(site.module, InnerCall)
        converted = isinstance(site.owner, AbstractConverted) and site.owner is not site.module and not holds_none
        if holds_none:
            counts = 0, 0
        elif not converted:
            state = state_among((site.args, site.kwargs))
            counts = parameter_counts(site.module, state, self.caller, at=site.path)
        output = site.call(*site.args, **site.kwargs)
        if converted:
            # Converted models count a layer's parameters during its call only.
            counts = site.owner.layer_parameter_counts(site.module)
        trainable, other = counts
        self.found[site.key] = dict(
            key=site.key,
            path=site.path,
            kind=site.kind,
            module_type=type(site.module).__name__,
            args=args,
            kwargs=kwargs,
            output=_shapes(output),
            trainable=trainable,
            non_trainable=other,
            call=site.call_index,
            lengths=site.lengths,
            stacks=tuple(level for level, _ in site.stacks),
            step_path=site.step_path,
            hookable=context.scopes.unthreadable() is None,
        )
        return output


def find_sites(model: Any, args: tuple, kwargs: dict, caller: str, inner: bool = False) -> tuple[SiteRow, ...]:
    """`px.sites`, refusing a model it cannot hook in the name of `caller`."""
    check_model(model, caller)
    finder = _SiteFinder(caller, inner)

    def run(model, args, kwargs):
        with hooking(model, finder) as context:
            return context.root(*args, **kwargs)

    with outside_its_vmap(caller, run_on_a_batch):
        eqx.filter_eval_shape(run, model, args, kwargs)
    calls: dict[str, int] = {}
    for facts in finder.found.values():
        calls[facts["path"]] = calls.get(facts["path"], 0) + 1
    _count_layers_once(finder.found.values())
    return tuple(SiteRow(**facts, calls=calls[facts["path"]]) for facts in finder.found.values())


def _count_layers_once(rows: Any) -> None:
    """A method site's parameters are its layer's: they show on the layer's own row, or,
    for a layer reached only through its methods (Gemma's `Embedder`: `encode` and
    `decode`), on its first method row, so that the rows of the top-level layers add up
    to the model's total."""
    rows = list(rows)
    called = {facts["path"] for facts in rows if facts["kind"] not in MEMBERS}
    counted = set()
    for facts in rows:
        if facts["kind"] not in MEMBERS:
            continue
        layer = facts["path"].rpartition(".")[0]
        if layer in called or layer in counted or not layer:
            facts["trainable"] = facts["non_trainable"] = 0
        counted.add(layer)


def sites(model: Any, *args: Any, inner: bool = False, **kwargs: Any) -> tuple[SiteRow, ...]:
    """Every call site that a hook can select, for these arguments, without running the
    model: path, kind, module type, input and output shapes and dtypes, parameters,
    repeated calls and stack length, found abstractly (`jax.eval_shape`).

    The keys are those of the logs that `px.ForwardHook` and `px.BackwardHook` return
    for the same arguments, in the order the calls return (a container after its
    children).

    **Arguments:**

    - `model`: an `eqx.Module`, or a model from `px.from_haiku`, `px.from_nnx`,
        `px.from_linen` or `px.from_function`. Anything else (an `nnx.Module`, a Haiku
        `hk.Transformed`) raises a `TypeError` that says how to convert it.
    - `*args`, `**kwargs`: example arguments (arrays or `jax.ShapeDtypeStruct`s).
    - `inner`: also list the sites inside layers (attention weights, functions named
        with `px.function_sites`), which only selections naming them select.

    **Returns:**

    A tuple of `px.SiteRow`, one per call.
    """
    return find_sites(model, args, kwargs, "px.sites", inner)
