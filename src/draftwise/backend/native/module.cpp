// The extension's Python module: the kernels of ragged_attention.cpp, row_ops.cpp, linear.cpp, quantized.cpp and
// ranking.cpp, and the decoder layer loop of layers.cpp.

#include <torch/extension.h>

#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
    module.def("ragged_attention", &ragged_attention, "Attention of ragged verification rows over block caches");
    module.def("rms_norm", &rms_norm, "RMSNorm of every row, padded to min_rows rows");
    module.def("silu_mul", &silu_mul, "silu(gate) * up of every row, padded to min_rows rows");
    module.def("blocked_linear_dtypes", &blocked_linear_dtypes, "The dtypes blocked_linear runs here");
    module.def("pack_blocked_weight", &pack_blocked_weight, "Weights packed for blocked_linear");
    module.def("blocked_linear", &blocked_linear, "x W^T + b from packed weights, batch invariant");
    module.def("quantized_linear", &quantized_linear,
               "x W^T + b from GGUF block-quantised weights repacked into tiles, batch invariant");
    module.def("top_tokens", &top_tokens, "The k largest values' indices of every row, best first");
    module.def("sampling_probabilities", &sampling_probabilities,
               "Each row's distribution after temperature, top-k, top-p and min-p");
    module.def("write_rows", &write_rows, "Rows' keys and values of every layer into block caches");
    module.def("rotate_queries_keys", &rotate_queries_keys, "Rotary embedding of the rows' queries (scaled) and keys");
    // (module_local: builds of other sources or flags may be loaded in one process beside this one.)
    pybind11::class_<DecoderLayers>(module, "DecoderLayers", pybind11::module_local())
        .def(pybind11::init<std::vector<torch::Tensor>, std::vector<torch::Tensor>,
                            std::vector<c10::optional<torch::Tensor>>, std::vector<int64_t>, std::vector<int64_t>,
                            int64_t, int64_t, double, double, int64_t>())
        .def("run", &DecoderLayers::run, "Every decoder layer over the rows; (hidden, keys, values)",
             pybind11::call_guard<pybind11::gil_scoped_release>())
        .def("__len__", &DecoderLayers::size);
}
