"""Haiku module names as local paths: `"mlp/~/linear_0"` is the layer `mlp.linear_0`."""


def haiku_path(module_name: str) -> tuple[str, ...]:
    """`"mlp/~/linear_0"` -> `("mlp", "linear_0")`: submodule (`/~/`) and name-scope
    (`/`) separators both become path separators, and a module created inside another
    module's method `m` (`"coder/~encode/down"`) sits under that method:
    `("coder", "encode", "down")`."""
    return tuple(
        segment.removeprefix("~") for segment in module_name.split("/") if segment not in ("", "~")
    )


def params_path(key: str) -> tuple[str, ...]:
    # Params of modules inside `layer_stack` sit under Haiku's internal scope
    # (`__layer_stack_no_per_layer/lin`) while the module itself is called as `lin`.
    return tuple(segment for segment in haiku_path(key) if not segment.startswith("__"))


def is_internal(module_name: str) -> bool:
    # Haiku's own plumbing (e.g. layer_stack's `__layer_stack_no_per_layer`, whose call
    # returns params) is not a layer of the user's model.
    return params_path(module_name) != haiku_path(module_name)
