"""A GGUF file loads as it is (``load_model(..., weights="file")``): no float copy of its quantised matrices, the
products packed once and cached, and a forward bitwise that of the quantised products checked against the model
transformers de-quantises from the same file (so every tensor went where it belongs: llama's query/key row order,
qwen2's biases, a tied or separate head, the token embedding looked up from its blocks)."""

from __future__ import annotations

import pytest
import torch
from gguf_files import LLAMA2_7B, QWEN25_7B, TINY_LLAMA, TINY_QWEN, write_random_gguf
from quantized_reference import relative_error
from tiny import prefill_and_chain_logits

import draftwise
from draftwise.backend import native
from draftwise.backend.forward.lean import LeanTarget
from draftwise.backend.weights import gguf_file
from draftwise.backend.weights.quantized import QuantizedLinear
from draftwise.errors import ModelLoadError
from draftwise.models import make_target

# (a condition string: evaluated when a test that needs the kernels runs, so the others never build them)
needs_kernels = pytest.mark.skipif("native.load_kernels(warn=False) is None",
                                   reason="the kernels cannot be built here")

PROMPT = [5, 17, 99, 3, 250, 41, 8, 300]
CHAIN = [12, 7, 7, 180, 64]


def float_model(path):
    """The float32 model transformers de-quantises from the GGUF file at ``path`` (the reference)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


@needs_kernels
@pytest.mark.parametrize(("shape", "type_name"), [(TINY_LLAMA, "Q4_0"), (TINY_QWEN, "Q4_K")],
                         ids=["llama-tied-q4_0", "qwen2-q4_k-q6_k-head"])
def test_a_file_runs_its_own_blocks_without_a_float_model(tmp_path, monkeypatch, shape, type_name):
    path = write_random_gguf(tmp_path / "model.gguf", shape, type_name)
    # (16-bit activations and a float32 cache: within 1e-3 of the float model, close enough to show every tensor went
    # where it belongs)
    target, tokenizer = draftwise.load_model(str(path), weights="file", calibrate=False, cache_dir=tmp_path,
                                             activation_bits=16, kv_cache_dtype="float32")
    assert tokenizer is not None and tokenizer.decode(tokenizer("hello")["input_ids"]) == "hello"
    assert all(isinstance(product, QuantizedLinear) for product in target.products)
    layer = target.model.model.layers[0]
    assert layer.self_attn.q_proj.weight.device.type == "meta"  # no float copy of a quantised matrix
    assert target.model.get_input_embeddings().weight.device.type == "meta"
    assert layer.input_layernorm.weight.device.type == "cpu" and target.device.type == "cpu"

    reference = float_model(path)
    checked = make_target(reference, weights="file", gguf_file=path, calibrate=False,  # each matrix checked
                          activation_bits=16, kv_cache_dtype="float32")
    ours = prefill_and_chain_logits(target, PROMPT, CHAIN, 32)
    for mine, theirs in zip(ours, prefill_and_chain_logits(checked, PROMPT, CHAIN, 32)):
        assert torch.equal(mine, theirs)
    for mine, theirs in zip(ours, prefill_and_chain_logits(LeanTarget(reference), PROMPT, CHAIN, 32)):
        assert relative_error(mine, theirs) < 1e-3

    def unreadable(*args, **kwargs):
        raise AssertionError("a cached model read the GGUF file again")

    monkeypatch.setattr(gguf_file, "GGUFWeights", unreadable)
    again, _ = draftwise.load_model(str(path), weights="file", calibrate=False, cache_dir=tmp_path, activation_bits=16,
                                    kv_cache_dtype="float32")
    for mine, theirs in zip(ours, prefill_and_chain_logits(again, PROMPT, CHAIN, 32)):
        assert torch.equal(mine, theirs)
    plain = draftwise.generate(again, tokenizer, prompt_ids=PROMPT, method="ar", max_new_tokens=12, ignore_eos=True)
    drafted = draftwise.generate(again, tokenizer, prompt_ids=PROMPT * 3, method="pld", max_new_tokens=12,
                                 ignore_eos=True)
    assert len(plain.token_ids) == 12
    assert drafted.token_ids == draftwise.generate(target, tokenizer, prompt_ids=PROMPT * 3, method="ar",
                                                   max_new_tokens=12, ignore_eos=True).token_ids


@needs_kernels
def test_a_damaged_cache_is_repacked_from_the_file(tmp_path):
    path = write_random_gguf(tmp_path / "model.gguf", TINY_QWEN, "Q6_K")
    first, _ = draftwise.load_model(str(path), weights="file", calibrate=False, cache_dir=tmp_path)
    (cached,) = (tmp_path / "gguf-packed").glob("*/packed.safetensors")
    cached.write_bytes(cached.read_bytes()[:1000])
    again, _ = draftwise.load_model(str(path), weights="file", calibrate=False, cache_dir=tmp_path)
    for mine, theirs in zip(prefill_and_chain_logits(first, PROMPT, CHAIN, 32),
                            prefill_and_chain_logits(again, PROMPT, CHAIN, 32)):
        assert torch.equal(mine, theirs)
    assert cached.stat().st_size > 1000


@needs_kernels
def test_a_file_that_does_not_fit_its_config_is_refused(tmp_path):
    path = write_random_gguf(tmp_path / "model.gguf", TINY_LLAMA, "Q8_0")
    data = bytearray(path.read_bytes())
    path.write_bytes(bytes(data[: len(data) // 2]))  # truncated: the tensors run past the end
    with pytest.raises(ModelLoadError, match="model.gguf"):
        draftwise.load_model(str(path), weights="file", calibrate=False, cache_dir=tmp_path)


@needs_kernels
def test_file_weights_run_on_the_lean_backend_and_the_cpu(tmp_path):
    path = write_random_gguf(tmp_path / "model.gguf", TINY_LLAMA, "Q8_0")
    with pytest.raises(draftwise.UnsupportedModelError, match="lean"):
        draftwise.load_model(str(path), weights="file", backend="transformers", calibrate=False, cache_dir=tmp_path)


LOAD_AND_DECODE = """
import json, os, sys, time
import torch
import draftwise

def resident_mb():
    with open(f"/proc/{os.getpid()}/status") as status:
        return int(status.read().split("VmRSS:")[1].split()[0]) // 1024

torch.set_num_threads(2)
import transformers  # (the libraries' own memory is not the model's)
before = resident_mb()
start = time.perf_counter()
target, tokenizer = draftwise.load_model(sys.argv[1], weights="file", calibrate=False, cache_dir=sys.argv[2])
loaded = time.perf_counter() - start
resident = resident_mb() - before
output = draftwise.generate(target, tokenizer, prompt_ids=list(range(3, 35)), method="ar", max_new_tokens=4,
                            ignore_eos=True)
print(json.dumps({"resident_mb": resident, "load_s": loaded, "tokens": output.token_ids,
                  "quantization": target.quantization}))
"""


@needs_kernels
@pytest.mark.slow
@pytest.mark.parametrize(("shape", "type_name"), [(LLAMA2_7B, "Q4_0"), (QWEN25_7B, "Q4_K")],
                         ids=["llama2-7b-q4_0", "qwen2.5-7b-q4_k"])
def test_a_7b_file_loads_in_5_gb_and_decodes(tmp_path, shape, type_name):
    """A model of Llama-2-7B's shape (random weights, 3.8 GB as Q4_0) or Qwen2.5-7B's (4.4 GB as Q4_K, a Q6_K head)
    loads on a 24 GB machine without ever holding float weights, resident in at most 5 GB (the packed products, the
    embedding's blocks; measured 3.8 and 4.7 GB), and decodes; the second load reads the cache."""
    import json
    import subprocess
    import sys

    path = write_random_gguf(tmp_path / "model.gguf", shape, type_name)
    runs = []
    for _ in range(2):
        finished = subprocess.run([sys.executable, "-c", LOAD_AND_DECODE, str(path), str(tmp_path / "cache")],
                                  capture_output=True, text=True, timeout=900, check=False)
        assert finished.returncode == 0, finished.stderr[-3000:]
        runs.append(json.loads(finished.stdout.strip().splitlines()[-1]))
    for run in runs:
        assert run["resident_mb"] <= 5 * 1024 and len(run["tokens"]) == 4
    assert runs[0]["tokens"] == runs[1]["tokens"] and runs[0]["quantization"] == runs[1]["quantization"]


@pytest.mark.parametrize(("shape", "type_name"), [(TINY_LLAMA, "Q4_1"), (TINY_QWEN, "Q4_K")],
                         ids=["llama-tied-q4_1", "qwen2-q4_k-q6_k-head"])
def test_a_file_runs_dequantized_where_the_kernels_do_not(tmp_path, device, shape, type_name):
    """The correct path for a GGUF file's blocks off the compiled CPU kernels (CUDA devices; the fixed step shape):
    the blocks dequantised on the device per call (or once, on a GPU with room), bitwise the forward of the float model transformers
    de-quantises from the same file (the same float32 weights in the same products), and drafting exact."""
    from draftwise.backend.forward.graphed import GraphedLeanTarget
    from draftwise.backend.weights.quantized import DequantizedLinear

    path = write_random_gguf(tmp_path / "model.gguf", shape, type_name)
    if device == "cuda":
        target, tokenizer = draftwise.load_model(str(path), weights="file", device=device, calibrate=False,
                                                 cache_dir=tmp_path)
        assert isinstance(target, GraphedLeanTarget) and target.graphs
        assert not list((tmp_path / "gguf-packed").glob("*/packed.safetensors"))  # (packed for CPU kernels only)
    else:
        weights = gguf_file.GGUFWeights(path)
        model = gguf_file.file_model(weights, gguf_file.file_config(path))
        target = GraphedLeanTarget(model, span=64, quantized=gguf_file.file_matrices(model, weights),
                                   embedding=gguf_file.file_embedding(model, weights))
        tokenizer = None
    assert target.dequantizing and target.device.type == device
    assert all(isinstance(product, DequantizedLinear) for product in target.products)
    # (a GPU with room keeps the float32 weights from the load on; a CPU the blocks)
    assert all((product.kept is not None) == (device == "cuda") for product in target.products)
    assert target.linear_path.startswith("dequantized-") and type_name.lower() in target.quantization
    assert target.model.model.layers[0].self_attn.q_proj.weight.device.type == "meta"

    # (the library's product, as the dequantised one runs: not oneDNN's packed weights)
    reference = GraphedLeanTarget(float_model(path).to(device), span=64, packed=False)
    ours = prefill_and_chain_logits(target, PROMPT, CHAIN, 32)
    for mine, theirs in zip(ours, prefill_and_chain_logits(reference, PROMPT, CHAIN, 32)):
        assert torch.equal(mine, theirs)
    plain = draftwise.generate(target, tokenizer, prompt_ids=PROMPT * 3, method="ar", max_new_tokens=12,
                               ignore_eos=True)
    drafted = draftwise.generate(target, tokenizer, prompt_ids=PROMPT * 3, method="pld", max_new_tokens=12,
                                 ignore_eos=True)
    assert drafted.token_ids == plain.token_ids


def test_a_file_runs_dequantized_without_the_kernels(tmp_path):
    """On a CPU the compiled kernels cannot run on, a file's blocks still run (dequantised per call: slower, correct),
    bitwise the float model's library forward."""
    path = write_random_gguf(tmp_path / "model.gguf", TINY_QWEN, "Q5_0")
    weights = gguf_file.GGUFWeights(path)
    model = gguf_file.file_model(weights, gguf_file.file_config(path))
    target = LeanTarget(model, kernel=False, packed=False, quantized=gguf_file.file_matrices(model, weights),
                        embedding=gguf_file.file_embedding(model, weights))
    assert target.dequantizing and target.linear_path.startswith("dequantized-q5_0")
    reference = LeanTarget(float_model(path), kernel=False, packed=False)
    for mine, theirs in zip(prefill_and_chain_logits(target, PROMPT, CHAIN, 32),
                            prefill_and_chain_logits(reference, PROMPT, CHAIN, 32)):
        assert torch.equal(mine, theirs)


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_K", "Q6_K"])
def test_embedding_rows_looked_up_few_or_many_are_the_decoded_table(type_name):
    """A decoding step's few tokens come from the rows kept since earlier lookups (bounded), many are decoded at
    once: the same values as the whole table decoded, in the tokens' order and shape."""
    from gguf_files import random_blocks

    from draftwise.backend.weights.quantized import decode

    blocks = random_blocks(type_name, 40, 256).reshape(40, -1)
    table = decode(blocks, type_name).dequantize()
    rows = gguf_file.EmbeddingRows(blocks, type_name)
    rows._recent_limit = 6
    for tokens in ([3], [3, 3, 9], [[1, 2], [3, 4]], list(range(40)), [39, 0, 5, 5, 7, 8, 9, 10, 3]):
        ids = torch.tensor(tokens)
        assert torch.equal(rows[ids], table[ids])
        assert len(rows.recent) <= 6


@needs_kernels
def test_max_model_len_caps_what_a_sequence_may_reach(tmp_path):
    """vLLM's ``max_model_len``: a smaller context than the model's, on every load path; a request past it is
    refused with the limit named, a limit past the model's context or not a positive number at load."""
    path = write_random_gguf(tmp_path / "model.gguf", TINY_LLAMA, "Q8_0")
    for weights in ("file", "float"):
        target, tokenizer = draftwise.load_model(str(path), weights=weights, calibrate=False, cache_dir=tmp_path,
                                                 max_model_len=64)
        assert target.context_length == 64
        draftwise.generate(target, tokenizer, prompt_ids=list(range(3, 40)), method="ar", max_new_tokens=8)
        with pytest.raises(draftwise.DraftwiseError, match="64"):
            draftwise.generate(target, tokenizer, prompt_ids=list(range(3, 70)), method="ar", max_new_tokens=8)
    for wrong in (0, -5, 2.5, True, 10**7):
        with pytest.raises(ModelLoadError, match="max_model_len"):
            draftwise.load_model(str(path), weights="file", calibrate=False, cache_dir=tmp_path, max_model_len=wrong)


def test_torch_compile_runs_the_gpu_step_compiled_and_is_refused_elsewhere(tmp_path, device):
    """``torch_compile`` (``--enable-torch-compile``): on a CUDA device every load path (the file's blocks, float
    weights) gives a compiled graphed step whose drafts keep plain decoding's ids; the compiled step traces a file's
    dequantised products too (checked on the CPU's eager steps); where there is no GPU step to compile (CPUs, the
    transformers backend) or the value is not a bool, a clear error at load."""
    from draftwise.backend.calibration.invariance import check_trees
    from draftwise.backend.forward.graphed import GraphedLeanTarget
    from draftwise.backend.weights.quantized import DequantizedRows, decode

    path = write_random_gguf(tmp_path / "model.gguf", TINY_LLAMA, "Q8_0")
    if device == "cpu":
        for options in ({}, {"weights": "float"}):
            with pytest.raises(ModelLoadError, match="torch_compile .*CUDA"):
                draftwise.load_model(str(path), calibrate=False, cache_dir=tmp_path, torch_compile=True, **options)
        with pytest.raises(ModelLoadError, match="torch_compile .*CUDA"):
            make_target(float_model(path), calibrate=False, torch_compile=True)
        with pytest.raises(ModelLoadError, match="true or false"):
            draftwise.load_model(str(path), calibrate=False, cache_dir=tmp_path, torch_compile="yes")
        weights = gguf_file.GGUFWeights(path)
        model = gguf_file.file_model(weights, gguf_file.file_config(path))
        embedding = gguf_file.file_embedding(model, weights)
        # (the embedding as a GPU holds it: rows dequantised on the device, looked up inside the step)
        embedding = DequantizedRows(decode(embedding.blocks, embedding.type_name), "cpu")
        target = GraphedLeanTarget(model, span=96, step_rows=8, compiled=True,
                                   quantized=gguf_file.file_matrices(model, weights), embedding=embedding)
        report = check_trees(target, trials=4, steps=12, prompt_length=13, seed=2)
        assert report.exact, report.mismatches[:3]
        targets = [(target, None)]
    else:
        targets = [draftwise.load_model(str(path), device=device, weights=weights, calibrate=False,
                                        cache_dir=tmp_path, torch_compile=True) for weights in ("file", "float")]
        with pytest.raises(ModelLoadError, match="transformers"):
            draftwise.load_model(str(path), device=device, backend="transformers", calibrate=False,
                                 cache_dir=tmp_path, torch_compile=True)
    for target, tokenizer in targets:
        assert target.compiled
        plain = draftwise.generate(target, tokenizer, prompt_ids=PROMPT * 3, method="ar", max_new_tokens=12,
                                   ignore_eos=True)
        drafted = draftwise.generate(target, tokenizer, prompt_ids=PROMPT * 3, method="pld", max_new_tokens=12,
                                     ignore_eos=True)
        assert drafted.token_ids == plain.token_ids
