// The extension's entry points, shared by the Python module (module.cpp) and the decoder layer loop (layers.cpp).

#pragma once

// (ATen's core headers: the kernels' sources need no more, and torch/extension.h, several times their size to compile,
// is module.cpp's alone.)
#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <string>
#include <tuple>
#include <vector>

at::Tensor ragged_attention(
    const at::Tensor& query, const at::Tensor& new_keys, const at::Tensor& new_values,
    const std::vector<at::Tensor>& key_caches, const std::vector<at::Tensor>& value_caches, int64_t layer,
    const at::Tensor& row_sequence, const at::Tensor& row_committed, const at::Tensor& path_offsets,
    const at::Tensor& path_rows);
at::Tensor rms_norm(const at::Tensor& hidden, const at::Tensor& weight, double eps, int64_t min_rows);
at::Tensor silu_mul(const at::Tensor& gate_up, int64_t rows, int64_t min_rows);
// Every layer's keys and values of rows ``first .. first + count - 1`` of ``keys`` and ``values`` (layers, rows,
// kv_heads, head_dim) into block caches (layers, blocks, kv_heads, block, head_dim) at positions ``slot`` on.
void write_rows(const at::Tensor& key_cache, const at::Tensor& value_cache, const at::Tensor& keys,
                const at::Tensor& values, int64_t slot, int64_t first, int64_t count);
std::tuple<at::Tensor, at::Tensor> rotate_queries_keys(
    const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& signed_sin, int64_t rows, int64_t heads,
    int64_t kv_heads, double scale);
std::vector<std::string> blocked_linear_dtypes();
at::Tensor pack_blocked_weight(const at::Tensor& weight);
at::Tensor blocked_linear(const at::Tensor& inputs, const at::Tensor& packed,
                          const c10::optional<at::Tensor>& bias, int64_t out_features);
at::Tensor quantized_linear(const at::Tensor& inputs, const at::Tensor& packed, int64_t format,
                            const c10::optional<at::Tensor>& bias, int64_t out_features, int64_t activation_bits);

// For the layer loop (not in the Python module): the operations above writing the first rows of a given output
// (contiguous, at least that many rows; its other rows left as they are), and the residual addition in place.
void ragged_attention_into(
    const at::Tensor& query, const at::Tensor& new_keys, const at::Tensor& new_values,
    const std::vector<at::Tensor>& key_caches, const std::vector<at::Tensor>& value_caches, int64_t layer,
    const at::Tensor& row_sequence, const at::Tensor& row_committed, const at::Tensor& path_offsets,
    const at::Tensor& path_rows, const at::Tensor& output);
void rms_norm_into(const at::Tensor& hidden, const at::Tensor& weight, double eps, const at::Tensor& out);
void silu_mul_into(const at::Tensor& gate_up, int64_t rows, const at::Tensor& out);
// The rotated queries into ``queries``, keys into ``keys`` and (unless undefined) the values copied into ``values``:
// keys and values in qkv's dtype, or float16 beside float32 rows (each element's own conversion, as torch's ``.to``).
void rotate_queries_keys_into(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& signed_sin, int64_t rows,
                              int64_t heads, int64_t kv_heads, double scale, const at::Tensor& queries,
                              const at::Tensor& keys, const at::Tensor& values);
void blocked_linear_into(const at::Tensor& inputs, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                         int64_t out_features, const at::Tensor& output);
void quantized_linear_into(const at::Tensor& inputs, const at::Tensor& packed, int64_t format,
                           const c10::optional<at::Tensor>& bias, int64_t out_features, int64_t activation_bits,
                           const at::Tensor& output);
// hidden (>= rows, dim) += the first ``rows`` rows of delta, in hidden's dtype (float32 sums rounded once, as torch's).
void add_rows_into(const at::Tensor& hidden, const at::Tensor& delta, int64_t rows);
// A ``*_into`` form's check of its output ``name``: contiguous, at least ``rows`` rows of ``width``, in ``dtype``.
void check_output_rows(const at::Tensor& out, int64_t rows, int64_t width, at::ScalarType dtype, const char* name);
// ``rows`` rows of ``width``, at least ``min_rows`` of them: those past ``rows`` zero.
at::Tensor padded_output(int64_t rows, int64_t min_rows, int64_t width, const at::TensorOptions& options);

std::tuple<at::Tensor, bool> top_tokens(const at::Tensor& logits, int64_t k);
at::Tensor sampling_probabilities(const at::Tensor& logits, double temperature, int64_t top_k, double top_p,
                                  double min_p);

// A model's decoder layers over packed weights (see layers.cpp).
class DecoderLayers {
   public:
    // Per layer, in order: norms (attention's, the MLP's), packed weights, biases (an undefined tensor: none) and
    // formats (-1: blocked_linear's float weights, else quantized_linear's format bits) of the products qkv, output,
    // gate_up, down; ``out_features`` of those four products; the quantised products' ``activation_bits``.
    DecoderLayers(std::vector<at::Tensor> norms, std::vector<at::Tensor> weights,
                  std::vector<c10::optional<at::Tensor>> biases, std::vector<int64_t> formats,
                  std::vector<int64_t> out_features, int64_t heads, int64_t kv_heads, double eps, double scale,
                  int64_t activation_bits);

    // Every layer over ``hidden`` (rows, dim); returns the last layer's hidden states and every layer's keys and
    // values of the rows, (layers, rows, kv_heads, head_dim) each, in the caches' dtype.
    std::tuple<at::Tensor, at::Tensor, at::Tensor> run(
        at::Tensor hidden, const at::Tensor& cos, const at::Tensor& signed_sin, int64_t min_rows,
        const std::vector<at::Tensor>& key_caches, const std::vector<at::Tensor>& value_caches,
        const at::Tensor& row_sequence, const at::Tensor& row_committed, const at::Tensor& path_offsets,
        const at::Tensor& path_rows) const;

    int64_t size() const { return static_cast<int64_t>(norms_.size() / 2); }

   private:
    void product(const at::Tensor& inputs, int64_t layer, int which, const at::Tensor& output) const;

    std::vector<at::Tensor> norms_, weights_;
    std::vector<c10::optional<at::Tensor>> biases_;
    std::vector<int64_t> formats_, out_features_;
    int64_t heads_, kv_heads_, activation_bits_;
    double eps_, scale_;
};
