"""The example notebook runs in a Jupyter kernel, and what it displays is rich: plots as
images, summaries and comparisons as HTML tables."""

import json
import sys
from pathlib import Path

import pytest

nbclient = pytest.importorskip("nbclient")
nbformat = pytest.importorskip("nbformat")
pytest.importorskip("ipykernel")

NOTEBOOK = Path(__file__).parent.parent / "examples" / "diagnostics.ipynb"


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    # A kernel spec for this interpreter (not whatever "python3" a machine has
    # installed), found first on JUPYTER_PATH.
    root = tmp_path_factory.mktemp("jupyter")
    spec = root / "kernels" / "this-python"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "this interpreter",
        "language": "python",
        "env": {"JAX_PLATFORMS": "cpu"},
    }))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("JUPYTER_PATH", str(root))
        notebook = nbformat.read(NOTEBOOK, as_version=4)
        client = nbclient.NotebookClient(
            notebook, timeout=600, kernel_name="this-python", resources={"metadata": {"path": str(root)}}
        )
        client.execute()
    return notebook


def outputs(notebook, tag):
    cells = [cell for cell in notebook.cells if tag in cell.metadata.get("tags", [])]
    assert cells, f"no cell tagged {tag!r}"
    return [cell.outputs for cell in cells]


def test_the_notebook_shows_plots_as_images(executed):
    for cell_outputs in outputs(executed, "plot"):
        # One result, an image: no "<Figure size ...>" line, no figure shown twice.
        assert [output.output_type for output in cell_outputs] == ["execute_result"]
        assert cell_outputs[0].data["image/png"]


@pytest.mark.parametrize("tag, text", [("summary", "layers.0"), ("recorder", "layers.1"), ("comparison", "layers.3")])
def test_the_notebook_shows_tables_as_html(executed, tag, text):
    (cell_outputs,) = outputs(executed, tag)
    (result,) = [output for output in cell_outputs if output.output_type == "execute_result"]
    assert result.data["text/html"].startswith("<table>") and text in result.data["text/html"]
    # The text form (terminals, plain viewers) is the same table, not a dataclass repr.
    plain = result.data["text/plain"].splitlines()
    assert text in result.data["text/plain"] and set(plain[1]) == {"-"}
