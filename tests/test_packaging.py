"""The package as installed: what `import peex_interop` loads, what a missing optional
library says, the public names and their API reference, and the docs site's coverage."""

import ast
import re
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest

import peex_interop as px
from peex_interop._adapters import LAZY
from peex_interop._optional import EXTRAS

ROOT = Path(__file__).parent.parent
PACKAGE = ROOT / "peex_interop"


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)


def without(modules: list[str], code: str) -> str:
    """`code`, run as if `modules` were not installed (their imports fail like a missing one)."""
    return f"""
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {modules!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, Block())
{code}
"""


def test_import_loads_no_optional_library():
    result = run_python("import sys, peex_interop; print(*sys.modules, sep='\\n')")
    assert result.returncode == 0, result.stderr
    loaded = {name.partition(".")[0] for name in result.stdout.split()}
    assert "peex_interop" in loaded
    assert not loaded & {*EXTRAS, "optax"}, loaded & {*EXTRAS, "optax"}


def test_import_works_with_every_optional_library_missing():
    result = run_python(without([*EXTRAS], "import peex_interop as px; print(px.ForwardHook.__name__)"))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ForwardHook"


# (what the user runs, the feature the error names, the library it needs)
MISSING = [
    *((f"px.{name}", f"px.{name}", library) for name, (_, library) in sorted(LAZY.items())),
    ("px.Recorder(tensorboard_dir='tb')", "px.Recorder(tensorboard_dir=...)", "tensorboardX"),
    ("px.Recorder(progress=True).track(range(2))", "px.Recorder(progress=True)", "tqdm"),
    ("px.Recorder().plot_layer_stats('layer')", "px.Recorder.plot_layer_stats", "matplotlib"),
    ("px.Recorder().color_dim('layer')", "px.Recorder.color_dim", "matplotlib"),
]


@pytest.mark.parametrize("library", sorted({m[2] for m in MISSING}))
def test_a_missing_optional_library_says_what_to_install(library, tmp_path):
    # One interpreter per missing library runs every feature that needs it.
    cases = [(statement, feature) for statement, feature, needed in MISSING if needed == library]
    code = "import peex_interop as px\n" + "".join(
        f"try:\n    {statement}\nexcept ImportError as e:\n    print(repr(e))\nelse:\n    print('no error')\n"
        for statement, _ in cases
    )
    result = subprocess.run(
        [sys.executable, "-c", without([library], code)], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    distribution, extra = EXTRAS[library]
    hint = f"needs {distribution}: pip install 'peex_interop[{extra}]'"
    assert result.stdout.splitlines() == [repr(ImportError(f"{feature} {hint}")) for _, feature in cases]


@pytest.mark.parametrize("name", sorted(LAZY))
def test_adapter_names_load_on_first_use(name):
    pytest.importorskip(LAZY[name][1])
    value = getattr(px, name)
    assert value.__name__ == name
    # Named by the adapter, defined in it (in one of its modules, for an adapter package).
    adapter = f"peex_interop._adapters{LAZY[name][0]}"
    assert value is getattr(sys.modules[adapter], name)
    assert value.__module__ == adapter or value.__module__.startswith(f"{adapter}.")


# Every library's adapter (a module, or a package of its own), and the modules its
# adapters share (`_flax`: both Flax APIs').
ADAPTERS = {"_equinox", "_function", "_haiku", "_linen", "_nnx"}


@pytest.mark.parametrize("adapter", sorted(ADAPTERS))
def test_no_adapter_imports_another(adapter):
    adapters = PACKAGE / "_adapters"
    package = adapters / adapter
    files = sorted(package.rglob("*.py")) if package.is_dir() else [package.with_suffix(".py")]
    imported = set()
    for file in files:
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level and node.module:
                base = file.parents[node.level - 1]
                target = base.joinpath(*node.module.split("."))
                if target.is_relative_to(adapters):
                    imported.add(target.relative_to(adapters).parts[0])
    assert not imported & (ADAPTERS - {adapter}), imported & ADAPTERS


def test_unknown_attribute_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'from_keras'"):
        px.from_keras  # noqa: B018


def test_all_lists_exactly_the_public_names():
    public = {name for name in vars(px) if not name.startswith("_")} - {"TYPE_CHECKING"}
    assert len(px.__all__) == len(set(px.__all__))
    assert set(px.__all__) == public | set(LAZY)
    assert set(px.__all__) <= set(dir(px))


def type_checking_imports(file: Path) -> dict[str | None, str]:
    """Name -> the module its `if TYPE_CHECKING:` block imports it from (relative)."""
    tree = ast.parse(file.read_text())
    block = next(n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING")
    return {
        alias.asname: ("." * node.level + (node.module or ""))
        for node in block.body
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }


def test_type_checkers_see_the_lazy_names():
    # The `if TYPE_CHECKING:` blocks import exactly the lazily loaded names: `_adapters`
    # from their adapters, the package from `_adapters`.
    assert type_checking_imports(PACKAGE / "_adapters" / "__init__.py") == {
        name: module for name, (module, _) in LAZY.items()
    }
    assert type_checking_imports(PACKAGE / "__init__.py") == dict.fromkeys(LAZY, "._adapters")


def imports(file: Path) -> list[tuple[ast.Import | ast.ImportFrom, set[str], bool, list[str]]]:
    """Each import in `file`: the package modules (paths without `.py`) or top-level
    libraries it names, whether it runs when the module is imported (not inside a
    function), and the `with` contexts around it. Imports for type checkers only (`if
    TYPE_CHECKING:`) never run and are left out."""
    found = []

    def targets(node: ast.Import | ast.ImportFrom) -> set[str]:
        if isinstance(node, ast.Import):
            return {a.name.partition(".")[0] for a in node.names}
        if not node.level:
            return {(node.module or "").partition(".")[0]}
        base = file.parent
        for _ in range(node.level - 1):
            base = base.parent
        names = [node.module] if node.module else [a.name for a in node.names]
        return {str(base.joinpath(*n.split("."))) for n in names}

    def visit(node: ast.AST, in_function: bool, guards: list[str]) -> None:
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            for child in node.orelse:
                visit(child, in_function, guards)
            return
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append((node, targets(node), not in_function, guards))
        if isinstance(node, ast.With):
            guards = [*guards, *(ast.unparse(i.context_expr) for i in node.items)]
        if isinstance(node, ast.FunctionDef) and node.name == "__rich__":
            guards = [*guards, "needs(rich calls it, 'rich')"]  # only rich itself calls `__rich__`
        for child in ast.iter_child_nodes(node):
            visit(child, in_function or isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef), guards)

    visit(ast.parse(file.read_text()), False, [])
    return found


def test_every_optional_import_says_what_to_install():
    # A feature that imports an optional library when called (directly, or through a
    # package module that imports it at the top) does so inside `needs(..., library)`.
    files = sorted(PACKAGE.rglob("*.py"))
    # A package is imported as its `__init__.py`.
    top = {
        str(f.parent if f.name == "__init__.py" else f.with_suffix("")): {
            t for _, ts, at_top, _ in imports(f) if at_top for t in ts
        }
        for f in files
    }

    def needed(target: str, seen: frozenset = frozenset()) -> set[str]:
        if target in EXTRAS:
            return {target}
        if target not in top or target in seen:
            return set()
        return {lib for t in top[target] for lib in needed(t, seen | {target})}

    problems = []
    for file in files:
        for node, targets, at_top, guards in imports(file):
            if at_top:
                continue
            for library in {lib for t in targets for lib in needed(t)}:
                if not any(g.startswith(("needs(", "_needs(")) and repr(library) in g for g in guards):
                    where = f"{file.relative_to(ROOT)}:{node.lineno}"
                    problems.append(f"{where} imports {library} outside `with needs(..., {library!r})`")
    assert not problems, "\n".join(problems)


def test_version_is_the_installed_metadata_version():
    assert re.fullmatch(r"\d+\.\d+\.\d+", px.__version__)
    assert metadata.version("peex_interop") == px.__version__


def test_package_metadata():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0"
    assert "Apache License" in (ROOT / "LICENSE").read_text()[:200]
    assert (PACKAGE / "py.typed").exists()
    # The core needs only these three; each optional library has an extra that brings it.
    core = {re.match(r"[\w-]+", r)[0] for r in project["dependencies"]}
    assert core == {"jax", "equinox", "jaxtyping"}
    extras = project["optional-dependencies"]
    for distribution, extra in EXTRAS.values():
        assert any(r.startswith(distribution) for r in extras[extra]), (distribution, extra)


# -- the docs site ----------------------------------------------------------------------
def api_reference() -> str:
    return "\n".join(page.read_text() for page in sorted((ROOT / "docs/api").glob("*.md")))


def test_every_public_name_is_in_the_api_reference():
    documented = set(re.findall(r"^::: peex_interop\.(\w+)", api_reference(), flags=re.M))
    assert set(px.__all__) - documented == set(), "add these to docs/api/*.md"
    assert documented - set(px.__all__) == set(), "not public: remove from docs/api/*.md"


def test_every_page_and_example_is_on_the_site():
    config = (ROOT / "mkdocs.yml").read_text()
    nav = set(re.findall(r"^\s*- (?:[^:\n]+: )?([\w/.-]+\.md)\s*$", config, flags=re.M))
    pages = {p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md")}
    assert pages == nav
    examples = (ROOT / "docs/examples.md").read_text()
    included = set(re.findall(r'--8<-- "(examples/[\w.]+\.py)"', examples))
    assert included == {p.relative_to(ROOT).as_posix() for p in (ROOT / "examples").glob("*.py")}
    for notebook in (ROOT / "examples").glob("*.ipynb"):
        assert f"examples/{notebook.name}" in examples, f"docs/examples.md does not show {notebook.name}"
