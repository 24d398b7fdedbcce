"""The supported window of releases, and the one clear error outside it.

peex_interop reaches into JAX's tracing machinery (`_engine/_jax.py`), which moves from
one release to the next, so it supports a window: the JAX minor releases of the last
six months (0.10, 0.11, 0.12), with the Equinox, Flax and Haiku releases that went with
the first of them (equinox 0.13.7 and flax 0.12.7 came out days after jax 0.10.0, flax
0.12.7 being the first to require it; dm-haiku 0.0.16 was the newest Haiku then). It is
tested at these floors (`make test-floor`, pinned in `.ci/floor.txt`) and at the newest
releases (`make test`); `pyproject.toml` declares the same floors (a test checks that
the three agree). Newer releases are not refused: `tests/test_jax_internals.py` says
which of the engine's assumptions a new JAX breaks.

An older JAX or Equinox (the core) raises `UnsupportedVersionError` at `import
peex_interop`, before any module touches JAX's internals; an older Flax or Haiku when
its adapter is first used (`_optional.needs`).
"""

import re

from ._errors import UnsupportedVersionError

# Distribution (as pip names it) -> the oldest supported release.
FLOORS: dict[str, str] = {
    "jax": "0.10.0",
    "equinox": "0.13.7",
    "flax": "0.12.7",
    "dm-haiku": "0.0.16",
}
TESTED = "JAX 0.10 to 0.12"


def parse(version: str) -> tuple[int, ...]:
    """The release numbers of a version string, any suffix left out (`"0.12.0.1"` ->
    `(0, 12, 0, 1)`, `"0.11.0.dev20260101"` -> `(0, 11, 0)`, `"0.13.8rc1"` -> `(0, 13, 8)`)."""
    numbers = []
    for part in version.split("."):
        digits = re.match(r"\d+", part)
        if digits is None:
            break
        numbers.append(int(digits[0]))
        if digits[0] != part:
            break
    return tuple(numbers)


def require(distribution: str, installed: str) -> None:
    """Raise `UnsupportedVersionError` if `installed` is older than the floor of
    `distribution`.

    **Arguments:**

    - `distribution`: a key of `FLOORS`.
    - `installed`: the version installed (`jax.__version__`).
    """
    floor = FLOORS[distribution]
    if parse(installed) >= parse(floor):
        return
    upgrade = f"'{distribution}>={floor}'"
    if distribution == "jax":
        upgrade += f" 'jaxlib>={floor}' (or 'jax[cuda12]>={floor}' on GPUs)"
    others = ", ".join(f"{name}>={version}" for name, version in FLOORS.items() if name != distribution)
    raise UnsupportedVersionError(
        f"peex_interop needs {distribution}>={floor}, but {distribution} {installed} is installed. It supports "
        f"and is tested with {TESTED} (with {others}). Upgrade: pip install --upgrade {upgrade}",
        name=distribution,
    )


def _require_core() -> None:
    # What the running modules say they are (also for a source checkout); JAX first,
    # since importing Equinox (and jaxtyping) reads JAX's version too.
    import jax

    require("jax", jax.__version__)
    import equinox

    require("equinox", equinox.__version__)


_require_core()
