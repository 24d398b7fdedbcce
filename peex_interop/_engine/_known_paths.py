"""Which layers a model has: the one exception to the closed-world rule.

After a hooked call, every name and pattern the user gave must have reached a call
(`_closed_world.check_reached`): a typo must never give an empty log. A layer the model
*has* that simply did not run in this call is no error: a branch not taken, or
`hk.BatchNorm`'s moving averages (`mean_ema`), which evaluation mode reads but does not
call. It is absent from the log, as it is from the libraries' own interceptors.

- The layers a model has: those it lists (every Equinox layer; a converted model's
  `AbstractConverted.known_layers`: NNX's submodules, Haiku's modules named by its
  params and state, linen's by its variables, a function model's params paths), and
  those an earlier hooked call of the same converted model reached (`_reached`): a
  layer holding no parameters (`nn.Dropout`, an `hk.Sequential`, a dropout function)
  is known from its first hooked call on.
- A layer *did not run* when neither it nor anything under it (a sublayer, a site
  inside it) was called: a layer used only through a method other than `__call__`
  runs its sublayers, and still raises. And some layer of the model must have run: a
  call of which the engine saw nothing is not one whose layers did not run.
- A site inside a layer (attention weights, a function site, a method site) is not a
  layer: whether it runs depends on how its layer computes (a fused attention never
  forms its weights), so naming one is excused only where its layer did not run.
  Sites are told by their names (`weights`, the `px.function_sites` names) and by the
  method sites adapters list ahead (`AbstractConverted.method_paths`); a method site
  known only from an earlier call counts as a layer of its own.

The registry is keyed by what identifies a converted model from call to call, through
`jax.jit` retraces and state updates alike (`model_key`): its class, its static fields
(Haiku's `apply_fn`, linen's `definition`, a function model's `fn`; NNX and Equinox
models list every layer and need no registry) and the functions among its leaves (a
`HaikuFunction`'s `fn`), never its arrays. It holds the `_LIMIT` models used last, each
with the paths its calls reached, behind a lock (hooked calls may run in threads).
"""

import collections
import dataclasses
import threading
from collections.abc import Hashable, Iterable
from typing import Any

import jax.tree_util as jtu

from ._function_sites import declared_sites
from ._inner_sites import attention_site_names
from ._paths import AbstractConverted, join
from ._selection import glob_to_regex

# How many converted models the registry remembers (the least recently used go first).
_LIMIT = 256
_reached: collections.OrderedDict[Hashable, frozenset[str]] = collections.OrderedDict()
_lock = threading.Lock()


def model_key(model: AbstractConverted) -> Hashable | None:
    """What identifies `model` across calls and jit retraces: its class, static fields
    and functions among its leaves (not its arrays, which change from call to call);
    `None` where some of them cannot be hashed."""
    static = tuple(getattr(model, f.name) for f in dataclasses.fields(model) if f.metadata.get("static", False))
    functions = tuple(leaf for leaf in jtu.tree_leaves(model) if callable(leaf))
    key = (type(model), static, functions)
    try:
        hash(key)
    except TypeError:
        return None
    return key


def remember(models: Iterable[tuple[tuple[str, ...], Any]], seen: Iterable[str]) -> None:
    """Record the layers this call reached of each converted model among `models`
    (`(path, module)` pairs) that does not list every layer ahead of a call."""
    for path, model in models:
        if not isinstance(model, AbstractConverted) or model.lists_every_layer:
            continue
        start = len(join(*path)) + 1 if path else 0
        local = frozenset(p[start:] for p in seen if p and (not path or p.startswith(join(*path) + ".")))
        key = model_key(model) if local else None
        if key is None:
            continue
        with _lock:
            _reached[key] = _reached.pop(key, frozenset()) | local
            while len(_reached) > _LIMIT:
                _reached.popitem(last=False)


def _reached_by(model: AbstractConverted) -> frozenset[str]:
    key = model_key(model)
    if key is None:
        return frozenset()
    with _lock:
        return _reached.get(key, frozenset())


class Known:
    """The layers and method sites a hooked model has, and which ran in this call.

    **Arguments:**

    - `models`: `(path, module)` of every `eqx.Module` of the hooked model (converted
        models included).
    - `seen`: the paths of every call this call ran (sites inside layers included).
    - `root`: the hooked model (its `px.function_sites` name sites inside layers).
    """

    def __init__(self, models: Iterable[tuple[tuple[str, ...], Any]], seen: set[str], root: Any):
        self.layers: set[str] = set()
        self.methods: set[str] = set()
        for path, model in models:
            self.layers.add(join(*path))
            if isinstance(model, AbstractConverted):
                self.layers |= {join(*path, *local) for local in model.known_layers()}
                self.layers |= {join(*path, local) for local in _reached_by(model)}
                self.methods |= {join(*path, *local) for local in model.method_paths()}
        self.layers.discard("")
        self.site_names = inner_site_names(root)
        # Every call's path and the paths above it: what ran, or ran something inside.
        self.ran = {".".join(parts[:end]) for parts in (p.split(".") for p in seen) for end in range(len(parts) + 1)}
        self.any_layer_ran = any(seen)

    def _did_not_run(self, path: str) -> bool:
        """Whether the layer at `path` did not run: for a site (`blocks.attn.weights`,
        `embedder.attend`), whether its layer did not."""
        parent, _, last = path.rpartition(".")
        layer = parent if path in self.methods or last in self.site_names else path
        return bool(layer) and layer not in self.ran

    def names_only_layers_not_run(self, pattern: str) -> bool:
        """Whether `pattern` (a name or glob that selected no call) names layers (or
        method sites) the model has, none of which ran in this call, or sites inside
        such layers only: what did not run is absent from the log, not an error."""
        if not self.any_layer_ran:
            return False
        regex = glob_to_regex(pattern)
        named = [path for path in (*self.layers, *self.methods) if regex.match(path)]
        if not named:
            # A site inside a layer (`attn.weights`, `**.gelu`), whose layer is known.
            rest, _, last = pattern.rpartition(".")
            site = rest and last.strip("*?") and any(glob_to_regex(last).match(name) for name in self.site_names)
            if not site:
                return False
            layers = [path for path in self.layers if glob_to_regex(rest).match(path)]
            return bool(layers) and not any(path in self.ran for path in layers)
        return all(self._did_not_run(path) for path in named)


def inner_site_names(root: Any) -> set[str]:
    """The last path segments of the sites inside the layers of `root`: every
    attention's (`attn.weights`), and the functions its `px.function_sites` name."""
    return {*attention_site_names(), *declared_sites(root)}
