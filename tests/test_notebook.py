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


def _execute(nb, **env: str) -> None:
    """Run ``nb`` as Jupyter would: a ``python3`` kernel started in the notebook's own directory."""
    from nbclient import NotebookClient

    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        # The kernel imports the package from this checkout whether or not it is pip-installed.
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
        **env,
    }
    # The native ``python3`` kernel runs with this interpreter (jupyter_client maps "python" to sys.executable
    # and ipykernel provides the spec even when no kernelspec is installed).
    resources = {"metadata": {"path": str(NOTEBOOK.parent)}}
    client = NotebookClient(nb, timeout=900, kernel_name="python3", resources=resources)
    client.execute(env=env)  # raises CellExecutionError (with the traceback) if any cell fails


def test_install_cell_rejects_a_source_that_is_no_checkout(tmp_path):
    """On Colab the default source (the notebook's parent directory) is no checkout: one clear error
    naming the variable to set, before any pip or git runs."""
    import nbformat
    from nbclient.exceptions import CellExecutionError

    nb = nbformat.read(NOTEBOOK, as_version=4)
    nb.cells = [cell for cell in nb.cells if cell.cell_type == "code"][:1]
    with pytest.raises(CellExecutionError, match=r"DSPINE_SOURCE=.*is not a dspine_jax checkout"):
        _execute(nb, DSPINE_SOURCE=str(tmp_path))


def test_notebook_runs_on_cpu():
    import nbformat

    nb = nbformat.read(NOTEBOOK, as_version=4)
    _execute(nb, DSPINE_DEMO_MAX_NEW_TOKENS="16", DSPINE_DEMO_PROMPTS="1", DSPINE_DEMO_REPEATS="1")
    print("\ncell seconds:", _cell_seconds(nb))

    for cell in nb.cells:
        for o in cell.get("outputs", []):
            assert o.output_type != "error", f"{o.get('ename')}: {o.get('evalue')}"
    texts = _texts(nb)
    # The default source ("..") is the checkout the notebook lives in: found, already importable, no pip.
    assert any(f"dspine_jax from {REPO_ROOT} is already importable; skipping the install" in t for t in texts), texts
    summary_lines = [line for t in texts for line in t.splitlines() if line.startswith("SUMMARY ")]
    assert len(summary_lines) == 1, texts
    summary = json.loads(summary_lines[0][len("SUMMARY "):])
    assert summary["identical"] is True
    assert summary["backend"] == "cpu"
    assert summary["max_new_tokens"] == 16 and summary["prompts"] == ["code"]
    # Every token after the prefill's is committed by some verify step; the shipped drafter gets some of
    # its proposals accepted on code (a broken drafter or verify would give exactly τ = 1).
    assert summary["committed"] == 16 - 1 and summary["tau"] == pytest.approx(15 / summary["steps"])
    assert summary["tau"] > 1.0
    assert summary["speedup"] == pytest.approx(summary["spec_tok_s"] / summary["ar_tok_s"])
    pngs = [o for cell in nb.cells for o in cell.get("outputs", []) if "image/png" in o.get("data", {})]
    assert pngs, "the notebook drew no inline plot"
    print("notebook summary:", summary)
