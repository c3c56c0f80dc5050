// The extension's entry points, shared by the Python module (module.cpp) and the decoder layer loop (layers.cpp).

#pragma once

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

// A model's decoder layers over packed weights (see layers.cpp).
class DecoderLayers {
   public:
    // Per layer, in order: norms (attention's, the MLP's), packed weights and biases (an undefined tensor: none) of
    // the products qkv, output, gate_up, down; ``out_features`` of those four products.
    DecoderLayers(std::vector<torch::Tensor> norms, std::vector<torch::Tensor> weights,
                  std::vector<c10::optional<torch::Tensor>> biases, std::vector<int64_t> out_features, int64_t heads,
                  int64_t kv_heads, double eps, double scale);

    // Every layer over ``hidden`` (rows, dim); returns the last layer's hidden states and every layer's keys and
    // values of the rows, (layers, rows, kv_heads, head_dim) each.
    std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> run(
        torch::Tensor hidden, const torch::Tensor& cos, const torch::Tensor& signed_sin, int64_t min_rows,
        const std::vector<torch::Tensor>& key_caches, const std::vector<torch::Tensor>& value_caches,
        const torch::Tensor& row_sequence, const torch::Tensor& row_committed, const torch::Tensor& path_offsets,
        const torch::Tensor& path_rows) const;

    int64_t size() const { return static_cast<int64_t>(norms_.size() / 2); }

   private:
    torch::Tensor product(const torch::Tensor& inputs, int64_t layer, int which, int64_t min_rows) const;

    std::vector<torch::Tensor> norms_, weights_;
    std::vector<c10::optional<torch::Tensor>> biases_;
    std::vector<int64_t> out_features_;
    int64_t heads_, kv_heads_;
    double eps_, scale_;
};
