"""Which call sites a hook wrapper acts on: `layer_names` (peex) and `where=`."""

import dataclasses
import difflib
import functools
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from .._errors import HookError
from ._kinds import INNER_KINDS, KINDS

_WHERE_TAKES = (
    "glob patterns (str), module types, predicates (path, module) -> bool, px.kind/"
    "px.not_/px.all_of criteria, or a sequence of those"
)

Predicate = Callable[[str, Any], bool]


@functools.cache  # called per pattern at every call site while tracing
def glob_to_regex(pattern: str) -> re.Pattern:
    """`*` is one path segment, `**` any number of segments, `?` one character."""
    out = []
    i = 0
    while i < len(pattern):
        if pattern.startswith("**.", i):
            out.append(r"(?:[^.]+\.)*")
            i += 3
        elif pattern.startswith("**", i):
            out.append(r".*")
            i += 2
        elif pattern[i] == "*":
            out.append(r"[^.]*")
            i += 1
        elif pattern[i] == "?":
            out.append(r"[^.]")
            i += 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return re.compile("".join(out) + r"\Z")


# A log key's call number: `lin@1` is the second call of the layer `lin`.
_CALL = re.compile(r"@(\d+)\Z")


def split_call(pattern: str) -> tuple[str, int | None]:
    """`("lin", 1)` for `"lin@1"` (a name or pattern naming one call of a layer, as its
    log key does), `(pattern, None)` for one naming every call."""
    found = _CALL.search(pattern)
    return (pattern, None) if found is None else (pattern[: found.start()], int(found.group(1)))


@dataclasses.dataclass(frozen=True)
class Kind:
    """Selects layers of library-independent kinds (`px.KINDS`): `px.kind("linear")`
    selects `eqx.nn.Linear`, `hk.Linear` and `nnx.Linear` alike."""

    kinds: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Not:
    """Selects the layers its criterion does not select."""

    criterion: Any


@dataclasses.dataclass(frozen=True)
class AllOf:
    """Selects the layers every one of its criteria selects."""

    criteria: tuple[Any, ...]


# What `where=` accepts: one criterion or a sequence of them (any matching selects).
Criterion = str | type | Predicate | Kind | Not | AllOf
Where = Criterion | Sequence[Criterion] | None

# Every site: every layer, method and sown value (`**`), and the sites inside layers,
# which only a selection naming them selects (their kinds). What `px.sites(inner=True)`
# lists and `px.cache` keeps by default.
EVERY_SITE: tuple[Criterion, ...] = ("**", Kind(INNER_KINDS))


def kind(*kinds: str) -> Kind:
    """A `where=` criterion: layers of any of these kinds (see `px.KINDS`)."""
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        raise HookError(f"unknown layer kinds {unknown}; kinds are: {', '.join(KINDS)}")
    return Kind(kinds)


def not_(criterion: Any) -> Not:
    """A `where=` criterion: every layer that `criterion` does not select."""
    return Not(criterion)


def all_of(*criteria: Any) -> AllOf:
    """A `where=` criterion: layers that all of `criteria` select."""
    return AllOf(criteria)


def _matches(criterion: Any, path: str, module: Any, layer_kind: str) -> bool:
    if isinstance(criterion, str):
        return glob_to_regex(split_call(criterion)[0]).match(path) is not None
    if isinstance(criterion, type):
        return _is_kind(module, criterion)
    if isinstance(criterion, Kind):
        return layer_kind in criterion.kinds
    if isinstance(criterion, Not):
        return not _matches(criterion.criterion, path, module, layer_kind)
    if isinstance(criterion, AllOf):
        return all(_matches(c, path, module, layer_kind) for c in criterion.criteria)
    return bool(criterion(path, module))


def _is_kind(module: Any, kind: type) -> bool:
    return isinstance(module, kind) or (isinstance(module, type) and issubclass(module, kind))


def _as_tuple(value: Any, expected: str) -> tuple | None:
    if value is None:
        return None
    if isinstance(value, (str, type, Kind, Not, AllOf)) or callable(value):
        return (value,)
    try:
        return tuple(value)
    except TypeError:
        raise HookError(f"{expected}; got {value!r}") from None


@dataclasses.dataclass(frozen=True)
class Selection:
    """A call site is selected when its path is one of `names` (if given) and it matches
    any criterion of `where` (if given). The root model itself is never selected.
    `renames` maps paths to the keys their logs get (`px.rename`)."""

    names: tuple[str, ...] | None = None
    where: tuple[Criterion, ...] | None = None
    renames: tuple[tuple[str, str], ...] = ()

    @classmethod
    def make(
        cls, layer_names: Sequence[str] | None, where: Where, rename: dict[str, str] | None = None
    ) -> "Selection":
        renames = tuple(sorted((rename or {}).items()))
        targets = [target for _, target in renames]
        doubled = sorted({target for target in targets if targets.count(target) > 1})
        if doubled:
            raise HookError(
                f"rename= maps several layers to the same log key(s) {doubled}: their "
                "logs would overwrite each other (or their cotangents add up)"
            )
        criteria = _as_tuple(where, f"where= takes {_WHERE_TAKES}")
        for criterion in criteria or ():
            if not isinstance(criterion, (str, type, Kind, Not, AllOf)) and not callable(criterion):
                raise HookError(f"where= takes {_WHERE_TAKES}; got {criterion!r}")
        return cls(_as_tuple(layer_names, "layer_names takes a sequence of dotted layer paths"), criteria, renames)

    @property
    def rename(self) -> dict[str, str]:
        return dict(self.renames)

    @functools.cached_property  # asked at every site inside a layer while tracing
    def inner(self) -> "Selection":
        """The selection that sites inside layers are checked against: the exact names,
        and the criteria that name such sites (`names_inner`); nothing if none does."""
        where = None if self.where is None else tuple(c for c in self.where if names_inner(c))
        if where is None and self.names is None:
            where = ()
        return dataclasses.replace(self, where=where)

    @functools.cached_property
    def _name_paths(self) -> frozenset[str] | None:
        return None if self.names is None else frozenset(split_call(name)[0] for name in self.names)

    @functools.cached_property
    def names_calls(self) -> bool:
        """Whether a name or pattern names one call of a layer (`lin@1`)."""
        given = [*(self.names or ()), *(c for c in self.where or () if isinstance(c, str))]
        return any(split_call(p)[1] is not None for p in given)

    def selects(self, path: str, module: Any, layer_kind: str = "other") -> bool:
        """Whether the call is selected at every step, whichever call of its layer it is
        (`selects_call` tells that)."""
        if path == "":
            return False
        if self._name_paths is not None and path not in self._name_paths:
            return False
        if self.where is not None:
            return any(_matches(c, path, module, layer_kind) for c in self.where)
        return True

    def step_selects(
        self, path: str, roots: Sequence[str], lengths: Sequence[int]
    ) -> tuple[list[dict[int, int]], set[str]]:
        """For a call inside stacks of layers (`roots`: the layer each stack's step
        follows, outermost first) that `selects` does not select as a whole: the steps
        at which names and patterns select it, as alternatives of `{stack level: step}`
        (`"blocks.1.attn"` selects step 1 of the stack `blocks`; empty: not at all),
        and the names and patterns that matched."""
        if not roots:
            return [], set()
        segments = step_segments(path, roots)
        found, matched = [], set()
        for patterns in (self.names, None if self.where is None else [c for c in self.where if isinstance(c, str)]):
            if patterns is None:
                found.append([{}])
                continue
            hits = [
                (pattern, steps)
                for pattern in patterns
                for steps in steps_of(split_call(pattern)[0], segments, lengths)
            ]
            matched.update(pattern for pattern, _ in hits)
            found.append([steps for _, steps in hits])
        if not all(found):
            return [], set()
        both = [{**a, **b} for a in found[0] for b in found[1] if all(a[k] == b[k] for k in a.keys() & b.keys())]
        return both, matched

    def selects_call(
        self, path: str, module: Any, layer_kind: str, call: int, roots: Sequence[str], lengths: Sequence[int]
    ) -> bool:
        """Whether the `call`-th call of a selected layer is selected: names and patterns
        naming one call (`lin@1`, `blocks.1.attn@1`) select that call only. Among the
        names (and among `where=`), one that reaches the path and admits the call must
        exist."""
        if not self.names_calls:
            return True
        segments = step_segments(path, roots)

        def admits(criterion: Any) -> bool:
            if not isinstance(criterion, str):
                return _matches(criterion, path, module, layer_kind)
            pattern, number = split_call(criterion)
            reaches = glob_to_regex(pattern).match(path) is not None or bool(
                roots and steps_of(pattern, segments, lengths)
            )
            return reaches and number in (None, call)

        return all(criteria is None or any(admits(c) for c in criteria) for criteria in (self.names, self.where))

    def step_patterns(self) -> list[str]:
        """Names and patterns with a number segment: they may name one step of a stack,
        which only the call can tell (checked then)."""
        patterns = [*(self.names or ()), *(c for c in self.where or () if isinstance(c, str))]
        return [p for p in patterns if may_name_a_step(split_call(p)[0])]

    def validate(
        self, modules: dict[str, Any], model_name: str, inner_names: Iterable[str] = (), methods: Sequence[str] = (),
        sows: bool = False,
    ) -> None:
        """Every name and pattern must match some layer, method site (`methods`: their
        paths) or name a site inside a layer (one of `inner_names`: an attention's
        `weights`, a function's; any name where the model's layers may sow values,
        `sows`, which only the call tells): a typo must not silently log nothing.
        Predicates cannot be checked ahead of the call."""
        paths = [path for path in modules if path]
        sites = [*paths, *methods]
        inner = set(inner_names)
        for source, _ in self.renames:
            if not source or (source not in modules and source not in methods):
                raise HookError(_no_match("rename= path", source, sites, model_name))
        for given in self.names or ():
            name = split_call(given)[0]
            known = name in sites
            if not (known or could_be_step(name, sites) or could_be_inner(name, paths, inner, sows)):
                raise HookError(_no_match("layer name", given, sites, model_name))
        for criterion in self.where or ():
            if isinstance(criterion, str):
                pattern = split_call(criterion)[0]
                matched = any(glob_to_regex(pattern).match(p) for p in sites)
                inside = could_be_inner(pattern, paths, inner, sows)
                if not (matched or could_be_step(pattern, sites) or inside):
                    raise HookError(_no_match("where pattern", criterion, sites, model_name))
            elif isinstance(criterion, type):
                known = [modules[p] for p in paths if modules[p] is not None]
                if len(known) < len(paths):
                    continue  # some layers exist only during a call: nothing to check
                if not any(_is_kind(m, criterion) for m in known):
                    kinds = sorted({(m if isinstance(m, type) else type(m)).__name__ for m in known})
                    raise HookError(
                        f"where type {criterion.__name__} matches no layer of "
                        f"{model_name}; its layers are of types: {', '.join(kinds)}"
                    )


def names_inner(criterion: Any) -> bool:
    """Whether a `where=` criterion names sites *inside* layers (attention weights, the
    functions a layer calls) explicitly: a glob whose last segment is not only
    wildcards (`**.weights`, `blocks.*.attn.weights`), a kind (`px.kind(
    "attention_weights")`), or an `all_of` holding one. `where=None`, `"**"`, types,
    predicates and `not_` select layers only, so that adding sites inside layers
    leaves every existing selection's logs as they were."""
    if isinstance(criterion, str):
        return bool(criterion.rsplit(".", 1)[-1].strip("*?"))
    if isinstance(criterion, Kind):
        return True
    if isinstance(criterion, AllOf):
        return any(names_inner(c) for c in criterion.criteria)
    return False


def could_be_inner(pattern: str, paths: list[str], names: set[str], any_name: bool = False) -> bool:
    """Whether a name or pattern may name a site inside a layer (`attn.weights`,
    `**.gelu`): its last segment names one of the site names `names` (any name, with
    `any_name`: a sown value's) and the rest names a layer (`**` also the root), or
    there is no rest: a site of the root model is named by its name alone (`gelu`,
    `all_hidden_states`), as `px.sites` lists it. Such sites exist only during the call
    (checked then)."""
    rest, _, last = pattern.rpartition(".")
    named = any_name or any(glob_to_regex(last).match(name) for name in names)
    if not (last.strip("*?") and named):
        return False
    if not rest:
        return True  # a site of the root model: its name alone, as `px.sites` lists it
    return any(glob_to_regex(rest).match(p) for p in ["", *paths]) or could_be_step(rest, paths)


def may_name_a_step(pattern: str) -> bool:
    """Whether a name or pattern has a number segment, which may be the step of a stack
    of layers (`blocks.1.attn`) rather than a list index."""
    return any(part.isdigit() for part in pattern.split("."))


def step_path(path: str, roots: Sequence[str], labels: Sequence[str]) -> str:
    """`path` with each label after its stack's root (`blocks.attn` -> `blocks.1.attn`);
    a root that is not a prefix of the path (a library naming the stack's layers
    apart from the stack) gets no label."""
    return ".".join(part if label is None else str(label) for part, label in _labelled(path, roots, labels))


def _labelled(path: str, roots: Sequence[str], labels: Sequence[Any]) -> list[tuple[str, Any]]:
    # (segment, None) for the path's own segments, ("", label) for inserted steps.
    parts: list[tuple[str, Any]] = [(part, None) for part in path.split(".")]
    cuts = [(len(root.split(".")), label) for root, label in zip(roots, labels) if _is_prefix(root, path)]
    for position, label in sorted(cuts, key=lambda cut: -cut[0]):
        parts.insert(position, ("", label))
    return parts


def step_segments(path: str, roots: Sequence[str]) -> list[str | int]:
    """The path's segments with each stack's level number (an int) after its root."""
    return [label if label is not None else part for part, label in _labelled(path, roots, range(len(roots)))]


def _is_prefix(root: str, path: str) -> bool:
    return path == root or path.startswith(root + ".")


def steps_of(pattern: str, segments: list[str | int], lengths: Sequence[int]) -> list[dict[int, int]]:
    """`[{stack level: step}]` if `pattern` matches the step segments segment by segment
    (a step is named by its number; `*` and `**` never name a step), else `[]`."""
    parts = pattern.split(".")
    if "**" in parts or len(parts) != len(segments):
        return []
    steps: dict[int, int] = {}
    for part, segment in zip(parts, segments):
        if isinstance(segment, int):
            if part.isdigit():
                if int(part) >= lengths[segment]:
                    raise HookError(
                        f"{pattern!r} selects step {part} of a stack of {lengths[segment]} layers "
                        f"(steps 0 to {lengths[segment] - 1})"
                    )
                steps[segment] = int(part)
            else:
                return []  # only a number names a step: `blocks.*` stays `blocks`' children
        elif glob_to_regex(part).match(segment) is None:
            return []
    return [steps]


def could_be_step(pattern: str, paths: list[str]) -> bool:
    # Whether a pattern names one step of a stack of layers (`blocks.1.attn`): without
    # its number segments it matches a layer. Stacks are only known during the call.
    parts = pattern.split(".")
    if not any(part.isdigit() for part in parts):
        return False
    for drop in range(len(parts)):
        if parts[drop].isdigit():
            rest = glob_to_regex(".".join(parts[:drop] + parts[drop + 1 :]))
            if any(rest.match(p) for p in paths):
                return True
    return False


def _no_match(what: str, name: str, paths: list[str], model_name: str) -> str:
    close = difflib.get_close_matches(name, paths, n=5, cutoff=0.4) or paths[:10]
    return (
        f"{what} {name!r} matches no layer of {model_name}; "
        f"closest available paths: {', '.join(close)}"
    )
