"""Where a Haiku module call becomes a call site: what every converted Haiku model
shares (`AbstractHaiku`). While a hooking context is active, its call runs inside
`hk.intercept_methods`, and the interceptor hands every selected method call of every
Haiku submodule to `_context.call_site`, with the Haiku module name turned into a
dotted local path (`_transforms.py`, `_names.py`)."""

import functools
from collections.abc import Callable, MutableMapping, Sequence
from typing import Any, ClassVar

import equinox as eqx
import haiku as hk
import jax
from haiku._src import base as hk_base  # the frames: Haiku's per-transform Python state

from ..._engine import AbstractConverted, active, call_site, kind_of, register_shape_pass_save, snapshot_containers
from ._transforms import Transforms

HAIKU_KINDS: dict[type, str] = {
    hk.Linear: "linear",
    hk.ConvND: "conv",
    hk.ConvNDTranspose: "conv",
    hk.MultiHeadAttention: "attention",
    hk.LayerNorm: "norm",
    hk.BatchNorm: "norm",
    hk.GroupNorm: "norm",
    hk.RMSNorm: "norm",
    hk.Embed: "embedding",
    hk.RNNCore: "recurrent",
    hk.MaxPool: "pool",
    hk.AvgPool: "pool",
    hk.Sequential: "container",
    hk.nets.MLP: "container",
}


def _save_haiku_state() -> Callable[[], None]:
    """What a trace of Haiku code advances in this thread's frames, for the engine's
    shape-only passes (`_engine/_shape_pass.py`): the name counters and used names of
    every module being called (a module created in a `jax.vmap` body, or any body the
    engine runs abstractly first, would be named `mlp_1` in the real run), the modules'
    submodule sets, the key sequences (`hk.next_rng_key` would leave the abstract run's
    tracer in them), and the params and state dicts (`hk.set_state`, `init`)."""
    frames = list(hk_base.frame_stack)
    if not frames:
        return lambda: None
    held: list[Any] = []
    sequences = {}
    for frame in frames:
        held.extend(frame.counter_stack)
        held.extend(frame.used_names_stack)
        held.extend(entry.module._submodules for entry in frame.module_stack)  # pyright: ignore[reportPrivateUsage]
        # `apply` freezes the params: only `init` writes them.
        for bundles in (frame.state,) if frame.freeze_params else (frame.params, frame.state):
            if isinstance(bundles, MutableMapping):
                held.append(bundles)
                held.extend(bundle for bundle in bundles.values() if isinstance(bundle, MutableMapping))
        sequences.update({id(rng): rng for rng in frame.rng_stack if rng is not None})
    restore_containers = snapshot_containers(held)
    keys = [(rng, rng.internal_state) for rng in sequences.values()]

    def restore() -> None:
        restore_containers()
        for rng, state in keys:
            rng.replace_internal_state(state)

    return restore


register_shape_pass_save(_save_haiku_state)


def total_size(tree: Any) -> int:
    return sum(leaf.size for leaf in jax.tree.leaves(tree))


def layer_methods(methods: Sequence[str] | None) -> tuple[str, ...] | None:
    # A constructor call is not a layer call (and its module has no name yet).
    return None if methods is None else tuple(method for method in methods if method != "__init__")


class AbstractHaiku(AbstractConverted):
    """Routes Haiku method calls made during `run` to the engine's call sites."""

    methods: eqx.AbstractVar[tuple[str, ...] | None]
    # Modules are listed from the params and state: an `hk.Sequential`, `hk.DeepRNN` or
    # other module without parameters of its own is only known during the call.
    lists_every_layer: ClassVar[bool] = False

    def _intercepted(self, run: Callable[[], Any], *, applies: bool) -> Any:
        # `applies`: whether `run` opens the model's own transform (`apply`) or runs in
        # the enclosing one.
        if not active():
            return run()
        transforms = Transforms(len(hk_base.context_stack) + applies)
        interceptor = functools.partial(self._intercept, transforms)
        with hk.intercept_methods(interceptor):
            return run()

    def _intercept(self, transforms: Transforms, next_f, args, kwargs, context):
        local = transforms.local(self.methods, context)
        if local is None:
            return transforms.run(context, next_f, args, kwargs)
        method = None if context.method_name == "__call__" else context.method_name
        return call_site(
            self, next_f, args, kwargs, local=local, module=context.module, signature=context.orig_method,
            member=method,
        )

    def layer_kind(self, module: hk.Module) -> str:
        return kind_of(module, HAIKU_KINDS)

    def layer_parameter_counts(self, module: hk.Module) -> tuple[int, int]:
        # Haiku keeps non-trained values (BatchNorm's moving averages) in state.
        return total_size(module.params_dict()), total_size(module.state_dict())
