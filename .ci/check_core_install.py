"""Run in a venv where only `pip install .` (no extras) happened: the install brought
jax, equinox, jaxtyping and their dependencies and nothing else, and importing the
package loads neither Haiku nor Flax, whose adapters say what to install."""

import re
import sys
from importlib import metadata

CORE = ["jax", "equinox", "jaxtyping"]
# Installed by `python -m venv` itself, or the package under test.
TOOLING = {"pip", "setuptools", "wheel", "peex-interop"}


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def closure(names: list[str]) -> set[str]:
    """The distributions `names` require, transitively, leaving out their extras."""
    seen: set[str] = set()
    todo = [normalise(n) for n in names]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for requirement in metadata.requires(name) or []:
            if "extra ==" not in requirement.partition(";")[2]:
                todo.append(normalise(re.match(r"[A-Za-z0-9._-]+", requirement)[0]))
    return seen


installed = {normalise(d.metadata["Name"]) for d in metadata.distributions()}
unexpected = sorted(installed - closure(CORE) - TOOLING)
assert not unexpected, f"`pip install .` brought more than {CORE} and their dependencies: {unexpected}"

import peex_interop as px  # noqa: E402

loaded = sorted({"haiku", "flax", "matplotlib", "rich", "tensorboardX", "tqdm", "optax"} & set(sys.modules))
assert not loaded, f"`import peex_interop` imported optional libraries: {loaded}"
for name, extra in [("from_haiku", "haiku"), ("NnxModule", "flax")]:
    try:
        getattr(px, name)
    except ImportError as error:
        assert f"pip install 'peex_interop[{extra}]'" in str(error), error
    else:
        raise AssertionError(f"px.{name} loaded without its library installed")
print(f"core install: {len(installed)} distributions, all required by {', '.join(CORE)}; "
      "import peex_interop loads neither haiku nor flax")
