"""The quickstart notebook (notebooks/quickstart.ipynb) runs top to bottom on CPU, makes its
plots, and uses only public names of eagle3_jax."""

import re
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "quickstart.ipynb"


def _code(nb) -> list[str]:
    return [c.source for c in nb.cells if c.cell_type == "code"]


def test_notebook_is_valid_and_uses_public_names_only():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    code = _code(nb)
    # the install cell comes first and is skipped where eagle3_jax already imports
    assert "pip" in code[0] and 'find_spec("eagle3_jax") is None' in code[0]
    for src in code:
        assert not re.search(r"\beagle3_jax(\.\w+)*\._\w", src), src
        for names in re.findall(r"^\s*from eagle3_jax[\w.]* import (.+)$", src, re.M):
            assert not [n for n in re.split(r"[,\s()]+", names) if n.startswith("_")], names


def test_notebook_runs_top_to_bottom(tmp_path):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    # the kernel inherits this process's environment (conftest: CPU, the shared compilation cache)
    client = NotebookClient(nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}})
    start = time.perf_counter()
    client.execute()  # raises CellExecutionError, with the cell and its traceback, if a cell fails
    seconds = time.perf_counter() - start
    print(f"quickstart notebook: {seconds:.0f} s")
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(images) == 2, "expected the acceptance plot and the accuracy plot"
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "The answer is 154." in text  # the worked example, answered right at unlimited B
    assert "rounds per tier:" in text and "accuracy" in text
