"""The supported window: declared once in three places that agree, checked at import, and
outside it one clear error naming the installed and the supported versions."""

import re
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest

import peex_interop as px
from peex_interop import _optional, _versions

ROOT = Path(__file__).parents[1]


def test_pyproject_the_floor_constraints_and_the_import_check_agree():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = [*project["dependencies"], *project["optional-dependencies"]["haiku"],
                    *project["optional-dependencies"]["flax"]]
    declared = dict(re.fullmatch(r"([\w.-]+)>=([\w.]+)", r).groups() for r in requirements)
    pinned = dict(re.findall(r"^([\w.-]+)==([\w.]+)$", (ROOT / ".ci/floor.txt").read_text(), flags=re.M))
    for distribution, floor in _versions.FLOORS.items():
        assert declared[distribution] == floor, distribution
        assert pinned[distribution] == floor, distribution
    # The floor run pins every core library at its declared floor (`jaxtyping>=0.3`: 0.3.0).
    assert pinned["jaxlib"] == pinned["jax"]
    assert _versions.parse(pinned["jaxtyping"]) == (*_versions.parse(declared["jaxtyping"]), 0)


def test_the_installed_releases_are_in_the_window():
    for distribution, floor in _versions.FLOORS.items():
        assert _versions.parse(metadata.version(distribution)) >= _versions.parse(floor)


@pytest.mark.parametrize(
    "version, parsed",
    [
        ("0.12.0.1", (0, 12, 0, 1)),
        ("0.10.0", (0, 10, 0)),
        ("0.11.0.dev20260101", (0, 11, 0)),
        ("0.13.8rc1", (0, 13, 8)),
    ],
)
def test_versions_are_compared_by_their_release_numbers(version, parsed):
    assert _versions.parse(version) == parsed


def test_a_release_older_than_its_floor_is_refused_naming_both_versions():
    _versions.require("jax", "0.10.0")
    _versions.require("jax", "0.12.0.1")
    with pytest.raises(px.UnsupportedVersionError) as refused:
        _versions.require("jax", "0.9.2")
    message = str(refused.value)
    assert message.startswith("peex_interop needs jax>=0.10.0, but jax 0.9.2 is installed.")
    assert "JAX 0.10 to 0.12" in message and "pip install --upgrade 'jax>=0.10.0' 'jaxlib>=0.10.0'" in message
    assert isinstance(refused.value, ImportError) and isinstance(refused.value, px.PeexInteropError)


@pytest.mark.parametrize("library", ["jax", "equinox"])
def test_importing_with_a_core_library_older_than_its_floor_raises_one_clear_error(library):
    # A fresh interpreter, the library's version made older than the floor before the import.
    script = f"import {library}; {library}.__version__ = '0.7.2'; import peex_interop"
    run = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 1
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith(
        f"peex_interop._errors.UnsupportedVersionError: peex_interop needs "
        f"{library}>={_versions.FLOORS[library]}, but {library} 0.7.2 is installed."
    ), run.stderr
    # Raised by the check, before any module that touches JAX's internals was imported.
    assert "_engine/_jax.py" not in run.stderr and 'peex_interop/_versions.py"' in run.stderr


@pytest.mark.parametrize("module, distribution", [("haiku", "dm-haiku"), ("flax", "flax")])
def test_an_adapter_for_a_library_older_than_its_floor_is_refused_before_importing_it(
    module, distribution, monkeypatch
):
    monkeypatch.setattr(_optional.metadata, "version", lambda name: "0.0.1")
    imported = []
    refused = rf"needs {distribution}>=.*but {distribution} 0\.0\.1"
    with pytest.raises(px.UnsupportedVersionError, match=refused), _optional.needs(f"px.from_{module}", module):
        imported.append(module)
    assert imported == []
