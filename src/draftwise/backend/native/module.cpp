// The extension's Python module: the kernels of ragged_attention.cpp, row_ops.cpp, linear.cpp and ranking.cpp.

#include <torch/extension.h>

#include <string>
#include <tuple>
#include <vector>

torch::Tensor ragged_attention(
    const torch::Tensor& query, const torch::Tensor& new_keys, const torch::Tensor& new_values,
    const std::vector<torch::Tensor>& key_caches, const std::vector<torch::Tensor>& value_caches, int64_t layer,
    const torch::Tensor& row_sequence, const torch::Tensor& row_committed, const torch::Tensor& path_offsets,
    const torch::Tensor& path_rows);
torch::Tensor rms_norm(const torch::Tensor& hidden, const torch::Tensor& weight, double eps, int64_t min_rows);
torch::Tensor silu_mul(const torch::Tensor& gate_up, int64_t rows, int64_t min_rows);
std::tuple<torch::Tensor, torch::Tensor> rotate_queries_keys(
    const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& signed_sin, int64_t rows, int64_t heads,
    int64_t kv_heads, double scale);
std::vector<std::string> blocked_linear_dtypes();
torch::Tensor pack_blocked_weight(const torch::Tensor& weight);
torch::Tensor blocked_linear(const torch::Tensor& inputs, const torch::Tensor& packed,
                             const c10::optional<torch::Tensor>& bias, int64_t out_features);
std::tuple<torch::Tensor, bool> top_tokens(const torch::Tensor& logits, int64_t k);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
    module.def("ragged_attention", &ragged_attention, "Attention of ragged verification rows over block caches");
    module.def("rms_norm", &rms_norm, "RMSNorm of every row, padded to min_rows rows");
    module.def("silu_mul", &silu_mul, "silu(gate) * up of every row, padded to min_rows rows");
    module.def("blocked_linear_dtypes", &blocked_linear_dtypes, "The dtypes blocked_linear runs here");
    module.def("pack_blocked_weight", &pack_blocked_weight, "Weights packed for blocked_linear");
    module.def("blocked_linear", &blocked_linear, "x W^T + b from packed weights, batch invariant");
    module.def("top_tokens", &top_tokens, "The k largest values' indices of every row, best first");
    module.def("rotate_queries_keys", &rotate_queries_keys, "Rotary embedding of the rows' queries (scaled) and keys");
}
