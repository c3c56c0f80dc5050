"""Shared fixtures: tiny random transformers models (built in-process, no downloads) and a dummy tokenizer."""

from __future__ import annotations

import pytest
import torch
from tiny import CharTokenizer, make_tiny_model, planned, torch_threads


@pytest.fixture(autouse=True)
def _one_torch_thread(request):
    """Tiny models run fastest (and most predictably on a busy 2-core box) on one thread.

    Slow real-model tests keep torch's own thread count.
    """
    if request.node.get_closest_marker("slow") is not None:
        yield
        return
    with torch_threads(1):
        yield


@pytest.fixture(params=[
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.cuda,
                                pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]),
])
def device(request):
    """Each device the engine's forward runs on: the CPU always, a CUDA device where there is one (marked ``cuda``:
    ``pytest -m cuda`` runs those alone). On a GPU, :func:`tiny.planned` gives the graphed forward."""
    return request.param


@pytest.fixture
def transformers_rows_trusted(monkeypatch):
    """Tiny models passed as they are run on the transformers backend, whose verification rows are not bitwise one-row
    decoding's: unchecked, it verifies no drafts (:class:`~draftwise.backend.target.TransformersTarget`). The tiny
    models' greedy tokens are far apart (see :func:`tiny.make_tiny_model`), so their greedy ids match even so: tests
    of the engine's and drafters' logic that pass the models as they are (``pytestmark =
    pytest.mark.usefixtures("transformers_rows_trusted")``) let that backend draft as if its rows had been found
    exact."""
    from draftwise.backend.target import TransformersTarget

    monkeypatch.setattr(TransformersTarget, "exact_trees", True)
    monkeypatch.setattr(TransformersTarget, "drafting_off_reason", None)


@pytest.fixture(scope="session")
def tiny_llama():
    return make_tiny_model("llama", seed=0)


@pytest.fixture(scope="session")
def tiny_qwen2():
    return make_tiny_model("qwen2", seed=0)


@pytest.fixture(scope="session", params=["llama", "qwen2"])
def tiny_model(request, tiny_llama, tiny_qwen2):
    """Each tiny model in turn."""
    return {"llama": tiny_llama, "qwen2": tiny_qwen2}[request.param]


@pytest.fixture(scope="session")
def char_tokenizer(tiny_llama):
    return CharTokenizer(tiny_llama.config.vocab_size)


@pytest.fixture(scope="module", params=["lean-float32", "lean-bfloat16", "transformers"])
def target(request, tmp_path_factory):
    """Each way the engine runs a model: the lean forward in two dtypes, and transformers' public forward (a tiny
    qwen2 model)."""
    backend, _, dtype = request.param.partition("-")
    model = make_tiny_model("qwen2", seed=0).to(getattr(torch, dtype or "float32"))
    if backend == "transformers":
        return model
    return planned(model, tmp_path_factory.mktemp("machine"))
