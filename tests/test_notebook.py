"""The Colab demo notebook, executed headless on CPU with a tiny budget (nbclient), and its outputs checked."""

from __future__ import annotations

import json
import os
from datetime import datetime
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO_ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = REPO_ROOT / "experiments" / "colab_demo.ipynb"


def _texts(nb) -> list[str]:
    """Every stream / text/plain output of every code cell, in order."""
    out = []
    for cell in nb.cells:
        for o in cell.get("outputs", []):
            if o.output_type == "stream":
                out.append(o.text)
            elif o.output_type in ("execute_result", "display_data") and "text/plain" in o.get("data", {}):
                out.append(o.data["text/plain"])
    return out


def _cell_seconds(nb) -> dict[int, float]:
    """Per executed code cell, its run time from nbclient's timing metadata (printed with ``-s``)."""
    out = {}
    for i, cell in enumerate(nb.cells):
        timing = cell.metadata.get("execution", {})
        if {"iopub.execute_input", "shell.execute_reply"} <= set(timing):
            start, end = (datetime.fromisoformat(timing[k].replace("Z", "+00:00"))
                          for k in ("iopub.execute_input", "shell.execute_reply"))
            out[i] = round((end - start).total_seconds(), 1)
    return out


def test_notebook_is_committed_without_outputs():
    import nbformat

    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    assert nb.metadata.kernelspec.name == "python3"
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None


def test_notebook_runs_on_cpu():
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(NOTEBOOK, as_version=4)
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "DSPINE_DEMO_MAX_NEW_TOKENS": "16",
        "DSPINE_DEMO_PROMPTS": "1",
        "DSPINE_DEMO_REPEATS": "1",
        # The kernel imports the package from this checkout whether or not it is pip-installed.
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
    }
    # The native ``python3`` kernel runs with this interpreter (jupyter_client maps "python" to sys.executable
    # and ipykernel provides the spec even when no kernelspec is installed).
    client = NotebookClient(nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(REPO_ROOT)}})
    client.execute(env=env)  # raises CellExecutionError (with the traceback) if any cell fails
    print("\ncell seconds:", _cell_seconds(nb))

    for cell in nb.cells:
        for o in cell.get("outputs", []):
            assert o.output_type != "error", f"{o.get('ename')}: {o.get('evalue')}"
    texts = _texts(nb)
    assert any("skipping the install" in t for t in texts)  # no clone / pip inside CI
    summary_lines = [line for t in texts for line in t.splitlines() if line.startswith("SUMMARY ")]
    assert len(summary_lines) == 1, texts
    summary = json.loads(summary_lines[0][len("SUMMARY "):])
    assert summary["identical"] is True
    assert summary["backend"] == "cpu"
    assert summary["max_new_tokens"] == 16 and summary["prompts"] == ["code"]
    assert 1.0 <= summary["tau"] <= 16.0
    assert summary["speedup"] > 0 and summary["ar_tok_s"] > 0 and summary["spec_tok_s"] > 0
    pngs = [o for cell in nb.cells for o in cell.get("outputs", []) if "image/png" in o.get("data", {})]
    assert pngs, "the notebook drew no inline plot"
    print("notebook summary:", summary)
