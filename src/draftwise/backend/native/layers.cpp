// The decoder layers of the lean forward in one call: the same kernels, in the same order, as the Python loop over
// layers (draftwise.backend.forward.lean), without its per-operation dispatch. A forward is about ten kernel calls per layer;
// from Python each also pays its argument conversion and the interpreter's own work: 0.3-0.4 ms of a 30-layer
// SmolLM2 forward (4.3-4.6 ms for one row), whatever its row count.

#include "kernels.h"

#include <ATen/TensorOperators.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/stack.h>

#include <utility>

namespace {
constexpr int kProducts = 4;  // qkv, output, gate_up, down
enum Product { kQkv = 0, kOutput = 1, kGateUp = 2, kDown = 3 };
}  // namespace

DecoderLayers::DecoderLayers(std::vector<at::Tensor> norms, std::vector<at::Tensor> weights,
                             std::vector<c10::optional<at::Tensor>> biases, std::vector<int64_t> formats,
                             std::vector<int64_t> out_features, int64_t heads, int64_t kv_heads, double eps,
                             double scale, int64_t activation_bits)
    : norms_(std::move(norms)), weights_(std::move(weights)), biases_(std::move(biases)), formats_(std::move(formats)),
      out_features_(std::move(out_features)), heads_(heads), kv_heads_(kv_heads), activation_bits_(activation_bits),
      eps_(eps), scale_(scale) {
    TORCH_CHECK(norms_.size() % 2 == 0 && !norms_.empty(), "norms: two per layer");
    const size_t layers = norms_.size() / 2;
    TORCH_CHECK(weights_.size() == kProducts * layers && biases_.size() == kProducts * layers &&
                    formats_.size() == kProducts * layers,
                "weights, biases and formats: four per layer");
    TORCH_CHECK(out_features_.size() == kProducts, "out_features: one per product");
}

// A linear product with at least ``min_rows`` rows (zeros past the inputs'), the rows of ``inputs`` returned, as
// draftwise.backend.weights.products.Linear computes it.
at::Tensor DecoderLayers::product(const at::Tensor& inputs, int64_t layer, int which, int64_t min_rows) const {
    const int64_t rows = inputs.size(0);
    at::Tensor padded = inputs.stride(1) == 1 ? inputs : inputs.contiguous();
    if (rows < min_rows) padded = at::cat({padded, padded.new_zeros({min_rows - rows, padded.size(1)})});
    const size_t index = kProducts * layer + which;
    auto output = formats_[index] < 0
                      ? blocked_linear(padded, weights_[index], biases_[index], out_features_[which])
                      : quantized_linear(padded, weights_[index], formats_[index], biases_[index], out_features_[which],
                                         activation_bits_);
    return rows < min_rows ? output.narrow(0, 0, rows) : output;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> DecoderLayers::run(
    at::Tensor hidden, const at::Tensor& cos, const at::Tensor& signed_sin, int64_t min_rows,
    const std::vector<at::Tensor>& key_caches, const std::vector<at::Tensor>& value_caches,
    const at::Tensor& row_sequence, const at::Tensor& row_committed, const at::Tensor& path_offsets,
    const at::Tensor& path_rows) const {
    const int64_t rows = hidden.size(0), dim = cos.size(1);
    const int64_t values_from = (heads_ + kv_heads_) * dim;
    TORCH_CHECK(!key_caches.empty(), "one key and value cache per sequence");
    const auto kv_type = key_caches.front().scalar_type();
    std::vector<at::Tensor> keys, values;
    keys.reserve(size());
    values.reserve(size());
    for (int64_t layer = 0; layer < size(); ++layer) {
        auto qkv = product(rms_norm(hidden, norms_[2 * layer], eps_, min_rows), layer, kQkv, min_rows);
        auto [layer_queries, layer_keys] = rotate_queries_keys(qkv, cos, signed_sin, rows, heads_, kv_heads_, scale_);
        auto layer_values = qkv.narrow(0, 0, rows).narrow(1, values_from, kv_heads_ * dim).view({rows, kv_heads_, dim});
        if (layer_keys.scalar_type() != kv_type) {  // (a float16 cache: this forward's rows rounded as it keeps them)
            layer_keys = layer_keys.to(kv_type);
            layer_values = layer_values.to(kv_type);
        }
        auto attended = ragged_attention(layer_queries, layer_keys, layer_values, key_caches, value_caches, layer,
                                         row_sequence, row_committed, path_offsets, path_rows);
        hidden = hidden + product(attended, layer, kOutput, min_rows);
        auto gate_up = product(rms_norm(hidden, norms_[2 * layer + 1], eps_, min_rows), layer, kGateUp, min_rows);
        auto down = product(silu_mul(gate_up, rows, min_rows), layer, kDown, min_rows);
        hidden = hidden + (down.size(0) > rows ? down.narrow(0, 0, rows) : down);
        keys.push_back(std::move(layer_keys));
        values.push_back(std::move(layer_values));
    }
    return {hidden, at::stack(keys), at::stack(values)};
}
