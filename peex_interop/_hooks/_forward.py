from collections.abc import Mapping, Sequence
from typing import Any

import equinox as eqx
from jaxtyping import PyTree

from .._engine import HookContext, Site, Where, hooking, pre_hook_inputs
from ._hooks import AbstractHook, HookLike, as_hook
from ._logs import AbstractLog, LogLike, NoneLog, as_log
from ._wrapper import AbstractHookWrapper, selection_fields


class ForwardHook(AbstractHookWrapper):
    """Wrap an Equinox module to hook and log the forward pass of its layers, at any
    depth.

    !!! Example

        ```python
        hooked = px.ForwardHook(mlp, log_fn=px.IdentityLog())
        output, log = hooked(x)  # log == {"linear1": ..., "linear2": ...}
        ```

    Keys of the log are dotted paths from `model` (`"layers.0"`, `"blocks.3.attn"`). A
    layer called again in the same forward pass logs under `"path@1"`, `"path@2"`, ...;
    a layer inside a `jax.vmap`/`jax.lax.scan` body logs once, stacked along the
    mapped/scanned axis. Explicit pre-logs (`pre_log_fn`) use the key `"path:in"`.
    """

    model: PyTree
    # `None` for no hook: a leaf-free module would be one more pytree node in every
    # copy of the hooked model's structure (the model, gradients, optimiser moments)
    # that a compiled step flattens and unflattens at every call.
    hook_fn: AbstractHook | None
    log_fn: AbstractLog
    log: dict
    pre_hook: bool = eqx.field(static=True)
    pre_hook_fn: AbstractHook | None
    pre_log_fn: AbstractLog | None

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
        pre_hook_fn: HookLike | None = None,
        pre_log_fn: LogLike | None = None,
    ):
        """**Arguments:**

        - `model`: the `eqx.Module` to hook (it is not modified).
        - `hook_fn`: applied to each selected layer's output (or, with `pre_hook=True`,
            to its positional `args` tuple, with floating-point arrays passed by keyword to
            positional parameters among them); must keep structure, shapes and dtypes.
            `None` (the default) leaves them unchanged, as `px.IdentityHook()` does.
        - `log_fn`: applied after `hook_fn`; its result is logged unless it is `None`.
        - `log`: entries to start the returned log with.
        - `pre_hook`: peex's switch: `hook_fn`/`log_fn` act on inputs instead.
        - `layer_names`: exact dotted paths to hook (peex); `None` for all layers.
        - `where`: glob pattern(s) over dotted paths (`*` one segment, `**` any depth),
            module type(s), predicate(s) `(path, module) -> bool`, or a sequence mixing
            them (a layer is hooked if any matches); `px.kind("linear")` selects a
            library-independent kind.
        - `rename`: `{path: key}`: log these layers under other keys (e.g. the keys of
            the model this one was ported from; see `px.rename`).
        - `pre_hook_fn`, `pre_log_fn`: hook and log of `(args, kwargs)` before the layer
            runs, independent of the post-hook.

        A plain callable is accepted wherever a hook or log is, and wrapped.
        """
        selection = selection_fields(model, "ForwardHook", layer_names, where, rename)
        self.model = model
        self.hook_fn = as_hook(hook_fn)
        self.log_fn = as_log(log_fn)
        self.log = dict(log or {})
        self.pre_hook = pre_hook
        self.layer_names = selection.names
        self.where = selection.where
        self.renames = selection.renames
        self.pre_hook_fn = as_hook(pre_hook_fn)
        self.pre_log_fn = as_log(pre_log_fn)

    def __call__(self, *args: Any, **kwargs: Any) -> tuple[Any, Mapping[str, Any]]:
        """Evaluate the wrapped model.

        **Arguments:**

        - `*args`, `**kwargs`: the model's own arguments.

        **Returns:**

        `(output, log)`: the model's (possibly hooked) output, and the log dictionary
        (a `px.PackedLog` mapping for statistics logs).
        """
        with hooking(self.model, self) as context:
            output = context.root(*args, **kwargs)
        if self.log or self.pre_log_fn is not None:
            return output, {**self.log, **context.logs}
        return output, self.log_fn.collect(context.logs)

    def run_site(self, context: HookContext, site: Site) -> Any:
        args, kwargs = site.args, site.kwargs
        if self.pre_hook_fn is not None:
            args, kwargs = context.apply_hook(
                site, "pre_hook_fn", self.pre_hook_fn, (args, kwargs)
            )
        if self.pre_log_fn is not None:
            logged = context.apply(site, "pre_log_fn", self.pre_log_fn, (args, kwargs))
            context.record(site, f"{site.key}:in", logged)
        if self.pre_hook:
            args, kwargs = pre_hook_inputs(site.path, "px.ForwardHook", site.signature or site.call, args, kwargs)
            if self.hook_fn is not None:
                args = context.apply_hook(site, "hook_fn", self.hook_fn, args)
            context.record(site, site.key, context.apply(site, "log_fn", self.log_fn, args))
            return site.call(*args, **kwargs)
        output = site.call(*args, **kwargs)
        if self.hook_fn is not None:
            output = context.apply_hook(site, "hook_fn", self.hook_fn, output)
        context.record(site, site.key, context.apply(site, "log_fn", self.log_fn, output))
        return output
