// The decoder layers of the lean forward in one call: the same kernels, in the same order, as the Python loop over
// layers (draftwise.backend.forward.lean), without its per-operation dispatch. A forward is about ten kernel calls per layer;
// from Python each also pays its argument conversion and the interpreter's own work: 0.3-0.4 ms of a 30-layer
// SmolLM2 forward (4.3-4.6 ms for one row), whatever its row count. Each kind of intermediate has one buffer for all
// layers, written in place (the kernels' ``*_into`` forms), and the residual stream is added to in place: a tensor
// allocated and a torch operation dispatched per step of a layer (three hundred a forward) cost another 0.25 ms of a
// SmolLM2 one-row forward (2.8 ms without the head, Zen 4).

#include "kernels.h"

#include <ATen/ops/empty.h>

#include <algorithm>
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

// A linear product of every row of ``inputs`` into ``output``, as draftwise.backend.weights.products.Linear computes
// it (the inputs already padded to the products' row count).
void DecoderLayers::product(const at::Tensor& inputs, int64_t layer, int which, const at::Tensor& output) const {
    const size_t index = kProducts * layer + which;
    if (formats_[index] < 0)
        blocked_linear_into(inputs, weights_[index], biases_[index], out_features_[which], output);
    else
        quantized_linear_into(inputs, weights_[index], formats_[index], biases_[index], out_features_[which],
                              activation_bits_, output);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> DecoderLayers::run(
    at::Tensor hidden, const at::Tensor& cos, const at::Tensor& signed_sin, int64_t min_rows,
    const std::vector<at::Tensor>& key_caches, const std::vector<at::Tensor>& value_caches,
    const at::Tensor& row_sequence, const at::Tensor& row_committed, const at::Tensor& path_offsets,
    const at::Tensor& path_rows) const {
    TORCH_CHECK(hidden.dim() == 2, "hidden: (rows, dim)");
    TORCH_CHECK(!key_caches.empty(), "one key and value cache per sequence");
    const int64_t rows = hidden.size(0), width = hidden.size(1), dim = cos.size(1);
    const int64_t padded = std::max(rows, min_rows);  // the products' row count
    const auto options = hidden.options();
    // One buffer per intermediate, reused by every layer. The products' inputs have ``padded`` rows, those past
    // ``rows`` zero: the kernels write only the first ``rows`` rows, so zeroed once they stay zero.
    auto normed = padded_output(rows, padded, width, options);
    auto attended = padded_output(rows, padded, heads_ * dim, options);
    auto gated = padded_output(rows, padded, out_features_[kGateUp] / 2, options);
    auto qkv = at::empty({padded, out_features_[kQkv]}, options);
    auto gate_up = at::empty({padded, out_features_[kGateUp]}, options);
    auto projected = at::empty({padded, width}, options);  // the output and down products'
    auto queries = at::empty({rows, heads_, dim}, options);
    // Every layer's keys and values in the caches' dtype (a float16 cache: this forward's rows rounded as it keeps
    // them, before any row attends to them).
    const auto kv_options = options.dtype(key_caches.front().scalar_type());
    auto keys = at::empty({size(), rows, kv_heads_, dim}, kv_options);
    auto values = at::empty({size(), rows, kv_heads_, dim}, kv_options);
    hidden = hidden.clone(at::MemoryFormat::Contiguous);  // the residual stream, added to in place
    for (int64_t layer = 0; layer < size(); ++layer) {
        const auto layer_keys = keys.select(0, layer), layer_values = values.select(0, layer);
        rms_norm_into(hidden, norms_[2 * layer], eps_, normed);
        product(normed, layer, kQkv, qkv);
        rotate_queries_keys_into(qkv, cos, signed_sin, rows, heads_, kv_heads_, scale_, queries, layer_keys,
                                 layer_values);
        ragged_attention_into(queries, layer_keys, layer_values, key_caches, value_caches, layer, row_sequence,
                              row_committed, path_offsets, path_rows, attended);
        product(attended, layer, kOutput, projected);
        add_rows_into(hidden, projected, rows);
        rms_norm_into(hidden, norms_[2 * layer + 1], eps_, normed);
        product(normed, layer, kGateUp, gate_up);
        silu_mul_into(gate_up, rows, gated);
        product(gated, layer, kDown, projected);
        add_rows_into(hidden, projected, rows);
    }
    return {hidden, keys, values};
}
