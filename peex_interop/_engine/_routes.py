"""Function routes: where a call of a function a layer makes becomes a site inside it.

A layer reaches a function through many references: a module's attribute
(`jax.nn.softmax`), a name imported into its module (`from flax.linen.attention import
dot_product_attention_weights`, as Hugging Face's models do), a partial in a table
(`ACT2FN["gelu_new"] = partial(nn.gelu, approximate=True)`), a field, a default
argument, a closure. Replacing names reaches the names only, so while hooking the
function itself is rerouted, by the kind of object it is:

- a Python function (`jax.nn.softmax`, `jax.nn.gelu`, Flax's
    `dot_product_attention_weights`): its code is swapped for a trampoline into the
    router, and swapped back after the call. Every reference holds that function
    object, so every call is reached.
- a `jax.custom_jvp` / `jax.custom_vjp` (`jax.nn.relu`): their class's `__call__`
    routes these objects' calls.
- a `jax.jit` of a Python function (`jax.nn.silu`): its module-global bindings are
    replaced (`_bindings.py`: those calls stay outside the jit), and the Python function
    it wraps is swapped as above, for the references no binding reaches (a partial, a
    field): those calls are sites inside the jit, threaded as a jit compiled before
    hooking (plain hooks and logs; hooks that read the call site are refused there).

Every route hands its calls to `route`, which decides per call which site, if any, the
call is: the attention weights of the attention layer running, where some selection
wants them, or else a function named with `px.function_sites`; any other call, and
every call made outside a hooked call (other threads included), runs as written.
"""

import contextlib
import functools
import inspect
import re
import threading
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax

from .._errors import HookError
from . import _patching
from ._bindings import bindings
from ._context import active
from ._inner_sites import WEIGHTS, attention_sites_wanted, inner_site, silenced, with_argument_sites
from ._sites import InnerCall
from ._threads import ThreadStack

# -- the decision ----------------------------------------------------------------------
# Functions whose call, made by an attention layer's own code, forms its attention
# weights: `jax.nn.softmax` (Gemma, Haiku), and the ones adapters register (Flax's
# `dot_product_attention_weights`, which also applies the weights' dropout).
_weights_functions: dict[int, Callable] = {id(jax.nn.softmax): jax.nn.softmax}

# `{id(function): site name}` of the `px.function_sites` wrappers running in this
# thread, innermost last.
_named = ThreadStack()

_ATTENTION_NAME = re.compile("attention|attn", re.IGNORECASE)


def register_weights_function(function: Callable) -> None:
    """Make `function`'s calls by an attention layer that layer's `.weights` site (an
    adapter registers its library's function that forms attention weights)."""
    _weights_functions[id(function)] = function


def is_attention_layer(kind: str, module: Any) -> bool:
    """Whether a layer is an attention layer, whose attention weights are a site:
    of kind `"attention"` in its library, or a class named like one (a model's own
    `FlaxGPT2Attention`, `Attention`, `SelfAttn`)."""
    cls = module if isinstance(module, type) else type(module)
    return kind == "attention" or _ATTENTION_NAME.search(cls.__name__) is not None


def route(function: Callable, original: Callable, args: tuple, kwargs: dict) -> Any:
    """Run a call of `function` (by `original`, which behaves as it was written) as
    the site it is, if any (see the module docstring)."""
    contexts = active()
    if not contexts or silenced.items or not contexts[-1].frames:
        return original(*args, **kwargs)
    frame = contexts[-1].frames[-1]
    if isinstance(frame.module, InnerCall):
        # A call inside a site is that site's own; inside attention weights being
        # formed, its arguments may be sites of the attention (the softmax's scores).
        if frame.module.kind == WEIGHTS.kind:
            args, kwargs = with_argument_sites(function, args, kwargs)
        return original(*args, **kwargs)
    weights = id(function) in _weights_functions and is_attention_layer(frame.kind, frame.module)
    if weights and attention_sites_wanted():
        # One call, one site: named by a `px.function_sites` too, it is the weights.
        _refuse_a_second_time(frame, function)
        return inner_site(*WEIGHTS, functools.partial(_forming, function, original), args, kwargs)
    for names in reversed(_named.items):
        name = names.get(id(function))
        if name is not None:
            return inner_site(name, "function", original, args, kwargs)
    return original(*args, **kwargs)


def _forming(function: Callable, original: Callable, *args: Any, **kwargs: Any) -> Any:
    """The weights site's own call of `function` (`jax.nn.softmax` itself, in Gemma),
    whose arguments may be sites of the attention too."""
    args, kwargs = with_argument_sites(function, args, kwargs)
    return original(*args, **kwargs)


def _refuse_a_second_time(frame: Any, function: Callable) -> None:
    """Attention weights formed twice in one call of a layer: which of the two is its
    `.weights` only the model's author can tell."""
    if frame.weights_formed:
        raise HookError(
            f"layer {frame.layer!r} ({type(frame.module).__name__}) forms attention weights twice in one call "
            f"({frame.weights_formed[0]}, then {_name(function)}): which one its `.weights` site is, is "
            "ambiguous. Name the function with px.function_sites and select its sites instead "
            "(`<layer>.<function>`, `@1` for the second call)."
        )
    frame.weights_formed.append(_name(function))


def _name(function: Callable) -> str:
    return getattr(function, "__name__", type(function).__name__)


# -- the routes --------------------------------------------------------------------------
class _Body:
    """A Python function's behaviour as a patchable attribute (`_patching`): reading
    `behaviour` gives a copy of the function as written (what a route calls); setting
    it to a replacement makes every call of the function, through any reference, a
    call of the replacement; setting the copy back restores the function."""

    __slots__ = ("function", "saved", "written")
    ATTRIBUTE = "behaviour"

    def __init__(self, function: types.FunctionType):
        object.__setattr__(self, "function", function)
        written = types.FunctionType(
            function.__code__, function.__globals__, function.__name__, function.__defaults__, function.__closure__
        )
        written.__kwdefaults__ = None if function.__kwdefaults__ is None else dict(function.__kwdefaults__)
        written.__dict__.update(function.__dict__)
        written.__qualname__, written.__module__ = function.__qualname__, function.__module__
        object.__setattr__(self, "written", written)
        object.__setattr__(self, "saved", None)

    @property
    def __dict__(self) -> dict:  # pyright: ignore[reportIncompatibleVariableOverride]
        return {self.ATTRIBUTE: getattr(self, self.ATTRIBUTE)}

    def __getattr__(self, name: str) -> Any:
        if name != self.ATTRIBUTE:
            raise AttributeError(name)
        if self.saved is None:
            return self.written
        return self.function.__kwdefaults__[_ROUTE]

    def __setattr__(self, name: str, value: Any) -> None:
        if name != self.ATTRIBUTE:
            raise AttributeError(name)
        function = self.function
        if value is self.written:
            code, defaults, kwdefaults, had_signature = self.saved
            function.__code__, function.__defaults__, function.__kwdefaults__ = code, defaults, kwdefaults
            if not had_signature:
                del function.__signature__
            object.__setattr__(self, "saved", None)
            return
        if self.saved is None:
            had_signature = "__signature__" in vars(function)
            saved = (function.__code__, function.__defaults__, function.__kwdefaults__, had_signature)
            signature = inspect.signature(self.written)
            object.__setattr__(self, "saved", saved)
            function.__code__ = _trampoline(len(function.__closure__ or ()))
            function.__defaults__ = None
            # Code that reads the signature while hooking sees the function's own.
            function.__signature__ = signature  # pyright: ignore[reportFunctionMemberAccess]
        function.__kwdefaults__ = {_ROUTE: value}


_ROUTE = "__peex_interop_route__"


@functools.cache
def _trampoline(free: int) -> types.CodeType:
    """The code of a function with `free` free variables (a function's code can only
    be swapped for code with as many as its closure has) that calls the route it is
    given as a keyword-only default."""
    cells = [f"_cell{i}" for i in range(free)]
    lines = ["def outer():", *(f"    {cell} = None" for cell in cells)]
    lines.append(f"    def trampoline(*args, {_ROUTE}, **kwargs):")
    if cells:
        lines.append(f"        {', '.join(cells)}")
    lines += [f"        return {_ROUTE}(*args, **kwargs)", "    return trampoline"]
    namespace: dict[str, Any] = {}
    exec("\n".join(lines), namespace)  # code made here, from names made here
    return namespace["outer"]().__code__


# One proxy per function, for ever: patches are counted per owner object, so
# overlapping calls must patch a function through the same proxy.
_bodies: dict[int, _Body] = {}
_bodies_lock = threading.Lock()


def _body(function: types.FunctionType) -> _Body:
    with _bodies_lock:
        body = _bodies.get(id(function))
        if body is None or body.function is not function:
            body = _bodies[id(function)] = _Body(function)
        return body


def _router(function: Callable) -> Callable[[Callable], Callable]:
    """A patch maker routing the calls of `function` (by a replacement of its body or
    of one of its bindings)."""

    def make(original: Callable) -> Callable:
        @functools.wraps(original)
        def routed(*args: Any, **kwargs: Any) -> Any:
            return route(function, original, args, kwargs)

        return routed

    make.purpose = ("function route", id(function))  # pyright: ignore[reportFunctionMemberAccess]
    return make


def _routed_call(original: Callable) -> Callable:
    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        return route(self, functools.partial(original, self), args, kwargs)

    return __call__


def route_patches(functions: Sequence[Callable], *code: Callable) -> list[tuple[Any, str, Any]]:
    """Patch targets routing every call of `functions` (see the module docstring);
    `code`: functions whose globals and closures may bind them outside any loaded
    module (`exec`uted code)."""
    targets: list[tuple[Any, str, Any]] = []
    bound = []
    for function in functions:
        function = _patching.unwrap(function)
        if isinstance(function, types.FunctionType):
            targets.append((_body(function), _Body.ATTRIBUTE, _router(function)))
        elif isinstance(function, (jax.custom_jvp, jax.custom_vjp)):
            if (type(function), "__call__", _routed_call) not in targets:
                targets.append((type(function), "__call__", _routed_call))
        else:
            bound.append(function)
            wrapped = inspect.unwrap(function, stop=lambda f: isinstance(f, types.FunctionType))
            if isinstance(wrapped, types.FunctionType):
                targets.append((_body(wrapped), _Body.ATTRIBUTE, _router(function)))
    for owner, name in bindings(bound, *code):
        targets.append((owner, name, _router(_patching.unwrap(getattr(owner, name)))))
    return targets


@contextlib.contextmanager
def named(functions: Sequence[tuple[str, Callable]], *code: Callable) -> Iterator[None]:
    """For the block, each call of one of `functions` (`(site name, function)`) made by
    a layer in this thread is the site `<layer>.<name>` (unless it is the layer's
    attention weights)."""
    names = {id(_patching.unwrap(function)): name for name, function in functions}
    with _patching.patched(route_patches([function for _, function in functions], *code)):
        _named.items.append(names)
        try:
            yield
        finally:
            _named.items.pop()


def weights_patches() -> list[tuple[Any, str, Any]]:
    """Patch targets routing the functions that form attention weights."""
    return route_patches(list(_weights_functions.values()))
