"""Optional dependencies: where a missing extra becomes an error that says what to install.

The core needs only jax, equinox and jaxtyping. Every other library is imported where a
feature first needs it, inside `needs(...)`, so that a user without it gets
`px.from_haiku needs dm-haiku: pip install 'peex_interop[haiku]'` instead of a bare
`No module named 'haiku'`. A feature's `needs` block names the one library it imports.
"""

import contextlib
from collections.abc import Iterator
from importlib import metadata

from ._versions import FLOORS, require

# Top-level module -> (the distribution pip installs, the extra of peex_interop that brings it).
EXTRAS: dict[str, tuple[str, str]] = {
    "haiku": ("dm-haiku", "haiku"),
    "flax": ("flax", "flax"),
    "matplotlib": ("matplotlib", "diagnostics"),
    "rich": ("rich", "diagnostics"),
    "tensorboardX": ("tensorboardX", "diagnostics"),
    "tqdm": ("tqdm", "diagnostics"),
}


@contextlib.contextmanager
def needs(feature: str, module: str) -> Iterator[None]:
    """Turn `module` missing, when the body imports it, into an `ImportError` that names
    `feature` and the `pip install` command that brings it.

    **Arguments:**

    - `feature`: what the user called, as they wrote it (e.g. `"px.from_haiku"`).
    - `module`: the optional top-level module the body imports (a key of `EXTRAS`).

    Any other missing module (one that `module` itself imports: a broken install) is
    re-raised as it is, since installing the extra again would not fix it. A library
    older than the supported window (`_versions.FLOORS`) raises
    `UnsupportedVersionError` before it is imported (an old Haiku may not import
    beside a new JAX at all).
    """
    distribution, extra = EXTRAS[module]
    if distribution in FLOORS:
        try:
            installed = metadata.version(distribution)
        except metadata.PackageNotFoundError:
            pass  # not installed: the import below says what to install
        else:
            require(distribution, installed)
    try:
        yield
    except ModuleNotFoundError as error:
        if (error.name or "").partition(".")[0] != module:
            raise
        raise ImportError(
            f"{feature} needs {distribution}: pip install 'peex_interop[{extra}]'", name=error.name
        ) from error
