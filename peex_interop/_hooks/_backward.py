from collections.abc import Sequence
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jaxtyping import Array, PyTree

from .._adapters import is_state
from .._engine import (
    TANGENT_SURVIVES_CUSTOM_VJP_IN_SCAN,
    CallSite,
    HookContext,
    Site,
    Where,
    call_with_site,
    check_same_shape,
    hooking,
    per_example,
    pre_hook_inputs,
    shape_only,
    zeros_like,
)
from .._errors import HookError, TransformError, outside_its_vmap
from ._hooks import AbstractHook, HookLike, as_hook
from ._logs import AbstractLog, LogLike, NoneLog, as_log
from ._wrapper import AbstractHookWrapper, selection_fields


class BackwardHook(AbstractHookWrapper):
    """Wrap an Equinox module to hook and log the cotangents flowing back through its
    layers, at any depth.

    !!! Example

        ```python
        @eqx.filter_grad
        def grad_loss(hooked, x):
            return jnp.mean(hooked(x))

        hooked = px.BackwardHook(model, log_fn=px.IdentityLog()).init(x)
        grads = grad_loss(hooked, x)
        grads.model  # gradients of the model's parameters
        grads.log    # {"linear1": cotangent of linear1's output, ...}
        ```

    As in peex, the log is an *input*: `.init(*args)` fills `log` with zero slots of
    the right shapes, and the gradient with respect to each slot is
    `log_fn(hook_fn(cotangent))`. Slots of layers inside `jax.vmap`/`jax.lax.scan`
    bodies carry the mapped/scanned axis, so their cotangents are per example/step. One
    step of a stack of layers (`where="blocks.1.attn"`) has a slot of one step's shape,
    and the hook edits that step's cotangent only. Around the backward pass
    (`jax.hessian`, a gradient of a function of the cotangents) a slot of the output's
    own shapes (`IdentityLog`) is differentiated as a perturbation of the layer's
    output; a slot of another shape (a statistic) has derivative zero there. A layer
    called in a `jax.vmap` body on inputs that do not vary over the batch (closed over,
    `in_axes=None`) still logs one cotangent per example, not their sum: its output is
    made per example (every row equal), so the computation after it runs per example.
    An `eqx.nn.State` that a layer returns (or, with `pre_hook=True`, takes) is its
    carried state, not an activation: `None` in what `hook_fn` and `log_fn` receive,
    its cotangent passed through unchanged, its batching left as the model made it.

    A Python float given to a layer (`model(1.0)`) is the array JAX makes of it: with
    `pre_hook=True` its cotangent is logged (Flax's own tests read it so). Only
    floating-point leaves have cotangents: integer (and boolean) leaves of a
    layer's output, or with `pre_hook=True` of its inputs (an argmax, VQ codes, token
    ids into an embedding), are `None` in what `hook_fn` and `log_fn` receive, and so in
    the log (`IdentityLog` logs `(cotangent, None)` for a layer returning `(y,
    indices)`). A call with no floating-point leaf at all runs neither; its log is
    `None` at every leaf (`(None,)` for an embedding's inputs). A `log_fn` returning
    integers or booleans raises `px.HookError`: a slot's gradient is floating-point.
    """

    model: PyTree
    # `None` for no hook, as `ForwardHook`'s.
    hook_fn: AbstractHook | None
    log_fn: AbstractLog
    log: dict
    pre_hook: bool = eqx.field(static=True)
    uses_probes: ClassVar[bool] = True

    def __init__(
        self,
        model: PyTree,
        hook_fn: HookLike | None = None,
        log_fn: LogLike = NoneLog(),
        log: dict[str, Any] | None = None,
        pre_hook: bool = False,
        layer_names: Sequence[str] | None = None,
        *,
        where: Where = None,
        rename: dict[str, str] | None = None,
    ):
        """**Arguments:**

        - `model`: the `eqx.Module` to hook (it is not modified).
        - `hook_fn`: applied to the cotangent of each selected layer's output (with
            `pre_hook=True`: of its positional inputs; `None` at integer leaves); must
            keep structure, shapes and dtypes. `None` (the default) leaves them
            unchanged, as `px.IdentityHook()` does.
        - `log_fn`: applied to the hooked cotangent; the result, floating-point arrays
            (or `None`), is the gradient of the layer's `log` slot.
        - `log`: the slots; leave empty and call `.init(*args)`.
        - `pre_hook`: hook the inputs' cotangents instead of the output's.
        - `layer_names`, `where`, `rename`: which layers and their log keys, as for
            `px.ForwardHook`.
        """
        selection = selection_fields(model, "BackwardHook", layer_names, where, rename)
        self.model = model
        self.hook_fn = as_hook(hook_fn)
        self.log_fn = as_log(log_fn)
        self.log = dict(log or {})
        self.pre_hook = pre_hook
        self.layer_names = selection.names
        self.where = selection.where
        self.renames = selection.renames

    def init(self, *args: Any, **kwargs: Any) -> "BackwardHook":
        """Fill `log` with zero slots shaped for a call with these arguments.

        The model runs once, abstractly. A per-example model with a collective over the
        vmap around it (`eqx.nn.BatchNorm(axis_name=...)`) needs that axis bound: call
        `init` inside that vmap, returning the hook unbatched
        (`eqx.filter_vmap(lambda x: hooked.init(x), axis_name=..., out_axes=None)(xs)`).

        **Arguments:**

        - `*args`, `**kwargs`: example arguments (only shapes and dtypes matter).

        **Returns:**

        A copy of this wrapper whose `log` holds one zero slot per hooked call.
        """

        def templates(hooked, args, kwargs):
            with hooking(hooked.model, hooked, discovering=True) as context:
                context.root(*args, **kwargs)
            return context.logs

        # A shape-only pass: a model run inside a live Haiku/linen call names modules and
        # draws keys afterwards as if it had not happened.
        with outside_its_vmap("BackwardHook.init", _init_inside_its_vmap), shape_only():
            shapes = eqx.filter_eval_shape(templates, self, args, kwargs)
        slots = zeros_like(shapes)
        return BackwardHook(
            self.model, self.hook_fn, self.log_fn, slots, self.pre_hook,
            self.layer_names, where=self.where, rename=self.selection.rename,
        )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Evaluate the wrapped model; the cotangent logs appear in gradients
        with respect to `self.log`.

        **Arguments:**

        - `*args`, `**kwargs`: the model's own arguments.

        **Returns:**

        The model's output.
        """
        with hooking(self.model, self, probes=self.log) as context:
            return context.root(*args, **kwargs)

    def run_site(self, context: HookContext, site: Site) -> Any:
        if self.pre_hook:
            args, kwargs = pre_hook_inputs(
                site.path, "px.BackwardHook", site.signature or site.call, site.args, site.kwargs
            )
            # A Python number has no cotangent of its own: it is the array JAX makes of
            # it (`model(1.0)`), as the layer's first operation on it would.
            args = tuple(jnp.asarray(a) if _is_number(a) else a for a in args)
            return site.call(*self._attach(context, site, args), **kwargs)
        return self._attach(context, site, site.call(*site.args, **site.kwargs))

    def _attach(self, context: HookContext, site: Site, value: Any) -> Any:
        # A layer's `eqx.nn.State` is what it carries to its next call, not an activation:
        # it bypasses the slot, its cotangent flowing back unchanged, and stays as
        # batched as the model made it (the Equinox idiom returns it from its vmap with
        # `out_axes=None`).
        states, value = eqx.partition(value, is_state, is_leaf=is_state)
        return eqx.combine(self._attach_to(context, site, value), states, is_leaf=is_state)

    def _attach_to(self, context: HookContext, site: Site, value: Any) -> Any:
        # Only floating-point leaves have a cotangent (JAX gives the others a float0
        # one, `filter_custom_vjp` None): hooks and logs see None in their place.
        cotangent_like = jtu.tree_map(
            lambda leaf: jnp.zeros(leaf.shape, leaf.dtype) if eqx.is_inexact_array(leaf) else None, value
        )
        flows_back = bool(jtu.tree_leaves(cotangent_like))
        if flows_back:
            template = context.apply(site, "log_fn", self.log_fn, cotangent_like)
            _check_differentiable(site.path, template)
        else:
            # Nothing flows back through this call (token ids into an embedding): no
            # hook or log runs; the log is None at each leaf.
            template = cotangent_like
        if context.discovering:
            context.record(site, site.key, template)
            return value
        slot = None if template is None else context.probe(site, template)
        if not flows_back:
            return value
        if site.lengths or context.scopes.carries():
            # In a vmap body, a value computed from inputs that do not vary over the
            # batch is computed once, and its cotangent would be the sum over the
            # examples; the slot is per example, so the value must be too.
            value = per_example(value)
        # Selected at some steps of a stack only: the hook edits the cotangents of those
        # steps; a one-step slot is shared by every step (`_Body.probes` spreads it), so
        # the others must add zeros to its gradient.
        steps = None if site.active is None else (site.active, site.one_step)
        # A log of the cotangent itself: its slot stands for a perturbation of the output.
        perturbs = _shapes(template) == _shapes(cotangent_like)
        try:
            return _cotangent_probe((value, slot, steps), self.hook_fn, self.log_fn, CallSite.of(site), perturbs)
        except TypeError as error:
            if "forward-mode" not in str(error):
                raise
            raise TransformError(
                f"BackwardHook cannot run under forward-mode autodiff (jax.jvp, "
                f"jax.jacfwd, jax.linearize) at layer {site.path!r}: it edits and logs "
                "cotangents with a custom VJP, which JAX cannot push tangents through. "
                "Use reverse mode (jax.grad, jax.vjp, jax.jacrev; jax.hessian works), "
                "or a ForwardHook for forward-mode transforms."
            ) from error


def _is_number(value: Any) -> bool:
    return isinstance(value, (float, complex)) and not isinstance(value, bool)


def _init_inside_its_vmap(axis_name: str) -> str:
    return (
        "Call init inside that vmap on a batch of examples, returning the hook unbatched: "
        f"eqx.filter_vmap(lambda x: hooked.init(x), axis_name={axis_name!r}, out_axes=None)(xs)"
    )


def _check_differentiable(path: str, template: Any) -> None:
    """A backward log is the gradient of its slot: refuse a `log_fn` whose outputs (all
    derived from floating-point cotangents) are integers, booleans or non-arrays."""
    discrete = [leaf for leaf in jtu.tree_leaves(template) if not eqx.is_inexact_array(leaf)]
    if discrete:
        got = f"{discrete[0].dtype} values" if eqx.is_array(discrete[0]) else f"a {type(discrete[0]).__name__}"
        raise HookError(
            f"BackwardHook log_fn at layer {path!r} returns {got}: a backward log is the "
            "gradient of its slot, which exists only for floating-point arrays (JAX would "
            "give None). Log counts in a ForwardHook instead."
        )


def _shapes(tree: Any) -> tuple[Any, list]:
    leaves, structure = jtu.tree_flatten(tree)
    return structure, [(leaf.shape, leaf.dtype) for leaf in leaves]


@jax.custom_jvp
def _perturbed_by(value: Array, slot: Array) -> Array:
    return value


@_perturbed_by.defjvp
def _perturbed_by_jvp(primals: tuple, tangents: tuple) -> tuple:
    # The value itself, untouched (no operation on it in any pass), with the slot's
    # tangent added: what `value + slot` would be at a zero slot, to every order.
    (value, _), (value_tangent, slot_tangent) = primals, tangents
    return value, value_tangent + slot_tangent


def _added(value: Array, slot: Array) -> Array:
    # JAX 0.10 and 0.11 drop `_perturbed_by`'s tangent inside a scanned custom_vjp
    # (`_jax.TANGENT_SURVIVES_CUSTOM_VJP_IN_SCAN`: second derivatives silently zero):
    # there the slot is added in the forward pass, its value stopped (`value + 0`).
    return value + (slot - jax.lax.stop_gradient(slot))


def _through_slot(value: Any, slot: Any, steps: Any, perturbs: bool) -> Any:
    """The layer's value, perturbed by its slot where the slot has the shapes of the
    value's floating-point leaves (`perturbs`: a log of the cotangent itself,
    `IdentityLog`): a derivative taken *around* the backward pass (`jax.hessian`, the
    gradient of a function of cotangents) then gives the slot the outer cotangent of
    the layer's output, as for any input of the model. The perturbation is a tangent
    only (`_perturbed_by`): the forward pass computes nothing more (on JAX 0.10 and
    0.11, one add of zero, `_added`: -0.0 becomes 0.0). A slot of another shape (a
    statistic) has no such meaning: its outer derivative is zero, as documented."""
    if not perturbs:
        return value
    if steps is not None:
        # A stack selected at some steps: the other steps' outputs stay unperturbed.
        active, _ = steps
        slot = jtu.tree_map(lambda s: jnp.where(active, s, jnp.zeros_like(s)), slot)
    perturbed_by = _perturbed_by if TANGENT_SURVIVES_CUSTOM_VJP_IN_SCAN else _added
    return jtu.tree_map(
        lambda s, v: v if s is None else perturbed_by(v, s), slot, value, is_leaf=lambda x: x is None
    )


@eqx.filter_custom_vjp
def _cotangent_probe(value_and_slot, hook_fn, log_fn, site, perturbs):
    del hook_fn, log_fn, site
    value, slot, steps = value_and_slot
    return _through_slot(value, slot, steps, perturbs)


@_cotangent_probe.def_fwd
def _cotangent_probe_fwd(perturbed, value_and_slot, hook_fn, log_fn, site, perturbs):
    del perturbed, hook_fn, log_fn, site
    value, slot, steps = value_and_slot
    return _through_slot(value, slot, steps, perturbs), None


@_cotangent_probe.def_bwd
def _cotangent_probe_bwd(residuals, cotangent, perturbed, value_and_slot, hook_fn, log_fn, site, perturbs):
    del residuals, perturbed, perturbs
    value, _, steps = value_and_slot
    # Symbolic-zero cotangents arrive as None; hooks and logs see real zeros.
    cotangent = jtu.tree_map(
        lambda c, v: jnp.zeros_like(v) if c is None and eqx.is_inexact_array(v) else c,
        cotangent, value, is_leaf=lambda x: x is None,
    )
    try:
        edited = cotangent
        if hook_fn is not None:
            edited = call_with_site(hook_fn, cotangent, site)
            check_same_shape(site.path, "hook_fn (backward)", cotangent, edited)
        logged = call_with_site(log_fn, edited, site)
    except Exception as error:
        error.add_note(f"peex_interop: raised by the BackwardHook at layer {site.path!r}")
        raise
    if steps is not None:
        active, one_step = steps
        edited = jtu.tree_map(lambda new, old: jnp.where(active, new, old), edited, cotangent)
        if one_step:
            logged = jtu.tree_map(lambda log: jnp.where(active, log, jnp.zeros_like(log)), logged)
    return edited, logged, eqx.filter(steps, eqx.is_inexact_array)  # no cotangent for the flags
