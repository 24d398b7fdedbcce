"""Interceptor parity (issue 40): every module method call that a library's own
interceptor observes is a `px.sites` site, or is on `EXCLUSIONS`, with the same number
of calls, and px lists no call the library does not see.

One helper per library runs the model under the library's own record of method calls:

- Haiku: `hk.intercept_methods` around `transformed.apply`;
- Flax linen: `nn.intercept_methods` around `module.apply` (a submodule `apply`-ed
  inside the model, as Hugging Face's GPT-2 does for its tied `lm_head`, is named by
  where that submodule sits: `nn.Module.apply` is wrapped for the duration of the run
  to keep a stack of the bound modules being applied);
- Flax NNX: `nnx.capture(model, method_outputs=...)`, the library's own instrumentation
  of `__call__` and the public methods of each module class in the model (see
  `nnx_parity` for what it cannot see by itself and how that is handled);
- Equinox, which has no interceptor: a recorder of our own in the way `nnx.capture`
  works (each `eqx.Module` class of the model has its `__call__` and public methods
  patched at class level for the duration of one eager call).

Each observed call becomes an `Observed` record; the calls not on `EXCLUSIONS` are
compared, as a multiset of `(module type, method, module path)`, with the rows of
`px.sites(model, *args, inner=False)` (a `"method"` row `coder.encode` is
`(type, "encode", "coder")`, any other row `(type, "__call__", path)`). Paths are
mapped from the library's names by the small functions below (no px internals).
"""

import collections
import contextlib
import dataclasses
import functools
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu

import peex_interop as px

Call = tuple[str, str, str]  # (module type name, method name, dotted module path)


@dataclasses.dataclass(frozen=True)
class Observed:
    """One method call as the library's own record sees it."""

    library: str  # "haiku", "linen", "nnx" or "equinox"
    module: Any  # the module object whose method ran
    owner: type | None  # the class whose body defines the method (None: not found)
    method: str  # the method's name
    path: str  # the module's dotted px-style path ("" for the root)
    root: bool  # the module is the model itself
    has_array: bool  # an array among the call's arguments
    check_trace: bool = False  # run in linen nn.scan's extra trace of its body (see `linen_parity`)
    reentry: bool = False  # the same method already runs on the same module (`super().__call__`)

    @property
    def call(self) -> Call:
        return type(self.module).__name__, self.method, self.path


@dataclasses.dataclass(frozen=True)
class Exclusion:
    """A kind of call that an interceptor sees and that is, by design, no site."""

    name: str
    reason: str
    applies: Callable[[Observed], bool]


def _owner(module: Any, method: str) -> type | None:
    """The class whose body defines `method` for `module` (first in its MRO)."""
    return next((klass for klass in type(module).__mro__ if method in vars(klass)), None)


def _class_attribute(observed: Observed) -> Any:
    return vars(observed.owner).get(observed.method) if observed.owner is not None else None


def _takes_no_argument(observed: Observed) -> bool:
    function = _class_attribute(observed)
    function = getattr(function, "__func__", function)
    try:
        parameters = list(inspect.signature(inspect.unwrap(function)).parameters.values())
    except (TypeError, ValueError):
        return False
    return len(parameters) <= 1 and not any(p.kind is p.VAR_POSITIONAL for p in parameters)


def _haiku_plumbing(observed: Observed) -> bool:
    # layer_stack's internal module (`__layer_stack_no_per_layer`, the body run in its
    # scan) and hk.lift's module (whose call runs the inner init) are Haiku's machinery.
    if observed.library != "haiku":
        return False
    name = getattr(observed.module, "module_name", "") or ""
    in_layer_stack = any(part.startswith("__layer_stack") for part in name.split("/"))
    return in_layer_stack or type(observed.module).__module__ == "haiku._src.lift"


def _linen_function_as_method(observed: Observed) -> bool:
    # A function that is no attribute of the module's class, run by linen as a method
    # of the module: the body of a lifted transform applied to a function
    # (`nn.RNN`'s `scan_fn(cell, carry, x)`), or `_validate_setup`'s `<lambda>` on a
    # throwaway clone of a module handed to a lifted transform.
    return observed.library == "linen" and observed.owner is None


# The exclusion list, each with its reason: what the docs list as the calls an
# interceptor sees that are no sites. The first that applies names a call's exclusion.
# Not on it, because no interceptor here reports them: methods of the libraries' base
# classes (linen and nnx.capture do not instrument nn.Module / nnx.Module; Haiku's
# hk.Module methods take no argument; the Equinox recorder patches classes below
# eqx.Module), nnx.List (nnx.capture skips it, and so does px), linen's `nowrap`
# methods and the classes its lifted transforms generate (linen intercepts neither).
EXCLUSIONS: tuple[Exclusion, ...] = (
    Exclusion(
        "the root's __call__",
        "the model's own call is the whole model, what the hooked call returns; not a site",
        lambda o: o.root and o.method == "__call__",
    ),
    Exclusion(
        "construction (__init__, setup)",
        "Haiku's __init__ and linen's setup build the module's layers; they compute nothing on data",
        lambda o: (o.library, o.method) in {("haiku", "__init__"), ("linen", "setup")},
    ),
    Exclusion(
        "a method re-entered on its module",
        "super().__call__() inside an override is part of the layer's one call (nnx.capture sows it twice)",
        lambda o: o.reentry,
    ),
    Exclusion(
        "private methods",
        "a method with a leading underscore (other than __call__) is the layer's implementation",
        lambda o: o.method.startswith("_") and o.method != "__call__",
    ),
    Exclusion(
        "properties",
        "Haiku intercepts property getters; reading an attribute is no call of a layer",
        lambda o: isinstance(_class_attribute(o), property),
    ),
    Exclusion(
        "methods taking no argument",
        "a method of self alone (eqx.nn.Sequential asks each layer is_stateful()) asks about the layer",
        lambda o: o.method != "__call__" and _takes_no_argument(o),
    ),
    Exclusion(
        "method calls given no array but random keys",
        "a method given no array but random keys builds things (hk.LSTM.initial_state(batch), mlp.reverse(), "
        "init_cache(size), cell.initialize_carry(shape, rngs))",
        lambda o: o.method != "__call__" and not o.has_array,
    ),
    Exclusion(
        "Haiku's layer_stack and hk.lift modules",
        "Haiku's own machinery: the layer_stack body module and the lift that runs an inner init",
        _haiku_plumbing,
    ),
    Exclusion(
        "linen's functions run as methods",
        "no method of the class: a lifted transform's body function (nn.RNN's scan_fn), flax's setup check (<lambda>)",
        _linen_function_as_method,
    ),
    Exclusion(
        "linen nn.scan's constancy-check trace",
        "nn.scan traces its body once more, first, to check its broadcast variables; px counts the scan's own trace",
        lambda o: o.check_trace,
    ),
)


def exclusion_of(observed: Observed) -> Exclusion | None:
    """The first exclusion that applies to `observed`, or None: it must be a site."""
    return next((exclusion for exclusion in EXCLUSIONS if exclusion.applies(observed)), None)


def has_array(args: tuple, kwargs: dict) -> bool:
    """Whether a call's arguments hold an array other than a random key (as px decides
    it for a method call: `cell.initialize_carry(shape, rngs)` is given keys only)."""
    return any(
        eqx.is_array(leaf) and not jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key)
        for leaf in jtu.tree_leaves((args, kwargs))
    )


@dataclasses.dataclass
class Parity:
    """What the library observed and what px lists, for one model and its arguments."""

    observed: list[Observed]
    rows: tuple  # px.sites rows

    @property
    def excluded(self) -> dict[str, list[Call]]:
        """Exclusion name -> the calls it removed."""
        out: dict[str, list[Call]] = collections.defaultdict(list)
        for observed in self.observed:
            exclusion = exclusion_of(observed)
            if exclusion is not None:
                out[exclusion.name].append(observed.call)
        return dict(out)

    @property
    def library_calls(self) -> collections.Counter:
        return collections.Counter(o.call for o in self.observed if exclusion_of(o) is None)

    @property
    def px_calls(self) -> collections.Counter:
        # Values a layer sows and its perturbation points are sites no method
        # interceptor sees (`sow` is no method call of the model's own): compared with
        # what `nnx.capture` collects in tests/test_coming_from.py.
        return collections.Counter(px_call(row) for row in self.rows if row.kind not in ("sown", "perturbation"))

    def check(self) -> None:
        """Assert that both multisets are equal, naming every difference."""
        library, listed = self.library_calls, self.px_calls
        missed, invented = library - listed, listed - library
        if missed or invented:
            lines = ["px.sites disagrees with the library's own record of method calls"]
            lines += [f"  px misses {n} call(s) of {call}" for call, n in sorted(missed.items())]
            lines += [f"  px invents {n} call(s) of {call}" for call, n in sorted(invented.items())]
            lines += ["library (not excluded):"] + [f"    {c} x{n}" for c, n in sorted(library.items())]
            lines += ["px.sites:"] + [f"    {c} x{n}" for c, n in sorted(listed.items())]
            raise AssertionError("\n".join(lines))
        assert library, "the library observed no call: nothing was compared"


def px_call(row: Any) -> Call:
    """A `px.sites` row as `(module type, method, module path)`."""
    if row.kind == "method":
        path, _, method = row.path.rpartition(".")
        return row.module_type, method, path
    return row.module_type, "__call__", row.path


def px_rows(model: Any, *args: Any, **kwargs: Any) -> tuple:
    return px.sites(model, *args, inner=False, **kwargs)


# -- Haiku ------------------------------------------------------------------------------
def haiku_path(module_name: str) -> str:
    """Haiku's module name as a px path: `mlp/~/linear_0` -> `mlp.linear_0` (`/~/`
    separates a submodule), `coder/~encode/down` -> `coder.encode.down` (a module
    created in the method `encode`), `multi_head_attention/query` -> ... (a name scope)."""
    parts = []
    for part in module_name.split("/"):
        if part in ("", "~"):
            continue
        parts.append(part[1:] if part.startswith("~") else part)
    return ".".join(parts)


def haiku_parity(transformed: Any, params: Any, state: Any, *args: Any, rng: Any = None, **kwargs: Any) -> Parity:
    """Run `transformed.apply` inside `hk.intercept_methods` and list `px.sites` of
    `px.from_haiku(transformed, params, state)` for the same arguments. `state` is None
    for a `hk.transform`ed function; `rng` is passed where `transformed.apply` takes one."""
    import haiku as hk

    records: list[tuple[Any, str, type, bool]] = []

    def record(next_f, call_args, call_kwargs, context):
        # The name is read after the call: `__init__` sets it.
        out = next_f(*call_args, **call_kwargs)
        records.append((context.module, context.method_name, context.orig_class, has_array(call_args, call_kwargs)))
        return out

    # Its leading arguments: params, the state (hk.transform_with_state), the rng key
    # (unless hk.without_apply_rng).
    leading = (params,) if state is None else (params, state)
    if "rng" in inspect.signature(transformed.apply).parameters:
        leading += (rng,)
    with hk.intercept_methods(record):
        transformed.apply(*leading, *args, **kwargs)
    observed = [
        Observed(
            "haiku", module, owner, method, haiku_path(getattr(module, "module_name", "") or ""), False, array
        )
        for module, method, owner, array in records
    ]
    model = px.from_haiku(transformed, params, state, rng=rng)
    return Parity(observed, px_rows(model, *args, **kwargs))


# -- Flax linen ---------------------------------------------------------------------------
class _CountingTraces:
    """JAX's `partial_eval` module as flax's `axes_scan` sees it while `linen_parity`
    runs: `nn.scan` (`axes_scan.scan`, which `nn.RNN` uses too) traces its body with
    `pe.trace_to_jaxpr_dynamic` (`trace_to_jaxpr_nounits` up to flax 0.12.8) to check
    that its broadcast variables are loop invariants, before `jax.lax.scan` traces it
    again; calls recorded meanwhile are marked (`Observed.check_trace`). Everything
    else is the module's."""

    def __init__(self, module: Any, depth: list[int]):
        self.module, self.depth = module, depth

    def __getattr__(self, name: str) -> Any:
        return getattr(self.module, name)

    def _counted(self, name: str, *args: Any, **kwargs: Any) -> Any:
        self.depth[0] += 1
        try:
            return getattr(self.module, name)(*args, **kwargs)
        finally:
            self.depth[0] -= 1

    def trace_to_jaxpr_dynamic(self, *args: Any, **kwargs: Any) -> Any:
        return self._counted("trace_to_jaxpr_dynamic", *args, **kwargs)

    def trace_to_jaxpr_nounits(self, *args: Any, **kwargs: Any) -> Any:
        return self._counted("trace_to_jaxpr_nounits", *args, **kwargs)


def linen_parity(
    module: Any, variables: Any, *args: Any, rngs: Any = None, mutable: Any = False, **kwargs: Any
) -> Parity:
    """Run `module.apply(variables, *args, **kwargs)` inside `nn.intercept_methods` and
    list `px.sites` of `px.from_linen(module, variables)` for the same arguments.

    A module's path is its scope path (`Dense_0`, `blocks.attn`). A submodule that the
    model `apply`-es with variables of its own (Hugging Face's GPT-2 runs
    `self.lm_head.apply({"params": {"kernel": wte.T}}, h)`) is the root of that inner
    `apply`, path `()`: `nn.Module.apply` is wrapped while the model runs, to know which
    bound module each inner `apply` runs, and its modules are named under that
    module's path (`lm_head`), as px names them. Only the outermost `apply`'s root is the
    model itself."""
    import flax.linen as nn
    from flax.core import axes_scan

    prefixes: list[tuple[str, ...]] = []
    records: list[tuple[Any, tuple[str, ...], bool, str, bool, bool]] = []
    original_apply = nn.Module.apply
    checking = [0]  # depth of nn.scan's constancy-check traces being run

    def apply(self, *apply_args, **apply_kwargs):
        # A bound module (a submodule of the running model) is named by its path in
        # the apply that runs it; an unbound one (the model) is the outermost root.
        bound = self.scope is not None
        prefixes.append(prefixes[-1] + tuple(self.path) if bound and prefixes else ())
        try:
            return original_apply(self, *apply_args, **apply_kwargs)
        finally:
            prefixes.pop()

    def record(next_f, call_args, call_kwargs, context):
        local = tuple(context.module.path)
        path = prefixes[-1] + local
        root = len(prefixes) == 1 and not local
        array = has_array(call_args, call_kwargs)
        records.append((context.module, path, root, context.method_name, array, checking[0] > 0))
        return next_f(*call_args, **call_kwargs)

    nn.Module.apply = apply  # pyright: ignore[reportAttributeAccessIssue]
    axes_scan.pe = _CountingTraces(axes_scan.pe, checking)  # pyright: ignore[reportAttributeAccessIssue]
    try:
        with nn.intercept_methods(record):
            module.apply(variables, *args, rngs=rngs, mutable=mutable, **kwargs)
    finally:
        nn.Module.apply = original_apply  # pyright: ignore[reportAttributeAccessIssue]
        axes_scan.pe = axes_scan.pe.module  # pyright: ignore[reportAttributeAccessIssue]
    observed = [
        Observed("linen", m, _owner(m, method), method, ".".join(map(str, path)), root, array, check)
        for m, path, root, method, array, check in records
    ]
    model = px.from_linen(module, variables, rngs=rngs, mutable=mutable)
    return Parity(observed, px_rows(model, *args, **kwargs))


# -- recording by patching classes (NNX, Equinox) -------------------------------------
_MISSING = object()


@contextlib.contextmanager
def _patched(targets: list[tuple[type, str, Any]]) -> Iterator[None]:
    """Set each `(class, name, value)`; restore on every path (`delattr` where the class
    had no attribute of its own)."""
    saved = [(cls, name, vars(cls).get(name, _MISSING)) for cls, name, _ in targets]
    try:
        for cls, name, value in targets:
            setattr(cls, name, value)
        yield
    finally:
        for cls, name, value in reversed(saved):
            if value is _MISSING:
                delattr(cls, name)
            else:
                setattr(cls, name, value)


class _Recorder:
    """Records each call of the methods it wraps as `(module, method, path, has array,
    re-entered)`, naming modules by identity.

    `walk(module)` lists `(path tuple, submodule)` of a module, itself first at `()`.
    A module unknown by identity was rebuilt inside a transform of the library
    (`nnx.scan` / `nnx.vmap` bodies, an Equinox stack rebuilt with `eqx.combine` in a
    scan): it is looked for among the submodules of the modules running around the
    call (a rebuilt parent's attributes are its rebuilt children), else it is the
    model's one module of its type and structure (`same(original, rebuilt)`); none or
    several raise. Rebuilt modules are kept alive for the run, so that their ids stay
    theirs."""

    def __init__(self, root: Any, walk: Callable, same: Callable[[Any, Any], bool]):
        self.walk, self.same = walk, same
        self.modules = list(walk(root))
        self.paths = {id(module): path for path, module in reversed(self.modules)}  # shared: first path
        self.kept: list[Any] = []
        self.running: list[tuple[Any, str]] = []  # (module, method) of the calls running
        self.calls: list[tuple[Any, str, tuple, bool, bool]] = []

    def path_of(self, module: Any) -> tuple:
        if id(module) in self.paths:
            return self.paths[id(module)]
        path = self._rebuilt_path(module)
        self.paths[id(module)] = path
        self.kept.append(module)
        return path

    def _rebuilt_path(self, module: Any) -> tuple:
        for parent, _ in reversed(self.running):
            for sub, candidate in self.walk(parent):
                if candidate is module:
                    return self.paths[id(parent)] + sub
        alike = [(path, m) for path, m in self.modules if type(m) is type(module)]
        if len(alike) > 1:
            alike = [(path, m) for path, m in alike if self.same(m, module)]
        assert len(alike) == 1, f"cannot name a rebuilt {type(module).__name__}: candidates {[p for p, _ in alike]}"
        return alike[0][0]

    def wrap(self, name: str, function: Any) -> Callable:
        @functools.wraps(function)
        def recorded(module, *args, **kwargs):
            path = self.path_of(module)
            reentry = any(m is module and n == name for m, n in self.running)
            self.calls.append((module, name, path, has_array(args, kwargs), reentry))
            self.running.append((module, name))
            try:
                return function.__get__(module, type(module))(*args, **kwargs)
            finally:
                self.running.pop()

        return recorded

    def observed(self, library: str) -> list[Observed]:
        return [
            Observed(library, m, _owner(m, method), method, ".".join(map(str, path)), not path, array, reentry=reentry)
            for m, method, path, array, reentry in self.calls
        ]


def _method_targets(classes: list[type], recorder: _Recorder, names: Callable[[type], list[str]]) -> list:
    """`(class, name, recording wrapper)` for each function `names(class)` lists."""
    return [
        (cls, name, recorder.wrap(name, vars(cls)[name]))
        for cls in classes
        for name in names(cls)
        if inspect.isfunction(vars(cls)[name])
    ]


# -- Flax NNX ------------------------------------------------------------------------------
@functools.cache
def _method_output_type() -> type:
    """A Variable type of its own for `nnx.capture`'s method outputs: what a model sows
    itself (`nnx.Intermediate`) is not mistaken for a method."""
    from flax import nnx

    class MethodOutput(nnx.Variable):
        pass

    return MethodOutput


def _nnx_base_classes() -> tuple[type, ...]:
    from flax import nnx

    return nnx.Module.__mro__  # nnx.Module and what it derives from: the library's


def _captured_names(cls: type) -> list[str]:
    """The attributes of `cls`'s own body that `nnx.capture` instruments (flax 0.12's
    `_add_capturing`), and the Equinox recorder too: callable, public or `__call__`."""
    return [name for name, value in vars(cls).items() if callable(value) and (name == "__call__" or name[0] != "_")]


def _inherited_names(cls: type) -> dict[str, Any]:
    """Methods `cls` inherits from a class of the model's library below `nnx.Module`
    (`class Inherited(nnx.Linear)`), that `nnx.capture` does not instrument on `cls`."""
    bases = _nnx_base_classes()
    inherited: dict[str, Any] = {}
    for klass in cls.__mro__[1:]:
        if klass in bases:
            continue
        for name in _captured_names(klass):
            if name not in vars(cls) and name not in inherited:
                inherited[name] = vars(klass)[name]
    return inherited


def _nnx_walk(module: Any) -> list[tuple[tuple, Any]]:
    from flax import nnx

    return list(nnx.iter_modules(module))


def _nnx_same(original: Any, rebuilt: Any) -> bool:
    from flax import nnx

    return nnx.graphdef(original) == nnx.graphdef(rebuilt)


def nnx_parity(model: Any, *args: Any, capture: bool = True, **kwargs: Any) -> Parity:
    """Run `model(*args, **kwargs)` (on a clone) under
    `nnx.capture(..., method_outputs=...)` and list `px.sites` of `px.from_nnx(model)`.

    The reference is `nnx.capture`'s record: `(*module path, method)` -> one output per
    call. What `nnx.capture` cannot tell, and how it is handled:

    - it instruments each class's own body only: a method a model class inherits from
      a class that is not in the model (`class Inherited(nnx.Linear)` without an
      `nnx.Linear` in the model) would be missed, so such methods are copied into the
      class's body for the run (the copy is what capture instruments);
    - it records outputs, not arguments: a `_Recorder` beneath its instrumentation
      (the same methods, patched first) tells, per call, whether the call was given an
      array and whether it re-enters a method already running on the same module
      (`super().__call__`, which capture sows twice). Its `(path, method)` counts must
      equal capture's.
    - it cannot run a model that carries a module through `nnx.scan` (`nnx.RNN`
      carries its cell: the values capture sows inside the body change the carry's
      structure, `TypeError: scan body function carry input and carry output must
      have the same pytree structure`): `capture=False` makes the `_Recorder`, which
      patches the same methods the same way, the reference.
    """
    from flax import nnx

    run = nnx.clone(model)  # the run advances BatchNorm statistics and RNG counts
    recorder = _Recorder(run, _nnx_walk, _nnx_same)
    classes = list(dict.fromkeys(type(m) for _, m in recorder.modules if not isinstance(m, nnx.List)))
    aliases = [(cls, name, value) for cls in classes for name, value in _inherited_names(cls).items()]
    with _patched(aliases), _patched(_method_targets(classes, recorder, _captured_names)):
        if capture:
            output = _method_output_type()
            _, captured = nnx.capture(run, output, method_outputs=output)(*args, **kwargs)
        else:
            run(*args, **kwargs)
    if capture:
        counts: collections.Counter = collections.Counter()
        for path, variable in nnx.to_flat_state(captured):
            *where, method = path
            counts[tuple(where), method] += len(variable.get_value())
        mine = collections.Counter((path, method) for _, method, path, _, _ in recorder.calls)
        assert mine == counts, f"the argument recorder disagrees with nnx.capture: {mine} != {counts}"
    return Parity(recorder.observed("nnx"), px_rows(px.from_nnx(model), *args, **kwargs))


# -- Equinox -------------------------------------------------------------------------------
def _key_part(key: Any) -> Any:
    for attribute in ("name", "idx", "key"):
        if hasattr(key, attribute):
            return getattr(key, attribute)
    return str(key)


def _equinox_walk(module: Any) -> list[tuple[tuple, Any]]:
    """`(path, submodule)` of an Equinox module, by `jax.tree_util` key paths: fields,
    list indices, dict keys (`seq.layers.0`, `by_name.a`)."""
    found = [((), module)]
    leaves = jtu.tree_flatten_with_path(module, is_leaf=lambda x: x is not module and isinstance(x, eqx.Module))[0]
    for keys, leaf in leaves:
        if isinstance(leaf, eqx.Module):
            prefix = tuple(_key_part(key) for key in keys)
            found += [(prefix + sub, m) for sub, m in _equinox_walk(leaf)]
    return found


def _equinox_same(original: Any, rebuilt: Any) -> bool:
    return jtu.tree_structure(original) == jtu.tree_structure(rebuilt)


def equinox_parity(model: Any, *args: Any, **kwargs: Any) -> Parity:
    """Run `model(*args, **kwargs)` eagerly with `__call__` and the public methods of
    every class of the model's modules (and their bases below `eqx.Module`) patched at
    class level by a `_Recorder` (Equinox has no interceptor: this records the way
    `nnx.capture` instruments NNX classes), and list `px.sites(model, ...)`.

    Paths are `jax.tree_util` key paths of the model, walked eagerly; modules rebuilt
    inside a transform (an `eqx.filter_vmap`-built stack run by `jax.lax.scan` through
    `eqx.combine`) are named as `_Recorder` says. Patches are restored on every path."""
    recorder = _Recorder(model, _equinox_walk, _equinox_same)
    classes = list(
        dict.fromkeys(
            klass
            for _, module in recorder.modules
            for klass in type(module).__mro__
            if issubclass(klass, eqx.Module) and klass is not eqx.Module
        )
    )
    with _patched(_method_targets(classes, recorder, _captured_names)):
        model(*args, **kwargs)
    return Parity(recorder.observed("equinox"), px_rows(model, *args, **kwargs))
