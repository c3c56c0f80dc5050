// Linear products (y = x W^T + b) for bfloat16 weights on CPUs with avx512_bf16, from weights packed once into
// tiles of 64 outputs.
//
// Packed layout: (ceil(N / 64), K / 2, 64, 2): tile t holds outputs 64t .. 64t + 63 (zero weights past N), and for
// each pair of inputs (2p, 2p + 1) four 64-byte vectors of their weight pairs, one per block of sixteen outputs. A
// row's sixteen outputs of a block are one register of sums, which vdpbf16ps updates with a broadcast pair of the
// row's inputs: no horizontal sums, each weight read once per tile of rows, each tile one contiguous stream.
//
// Every output is one float32 sum over the input pairs in order 0, 1, 2, ..., then the bias, rounded to bfloat16
// once (round to nearest even), by the same instruction sequence whichever tile of rows it falls in, so a row's
// bits never depend on how many rows the call holds: these products are batch invariant by construction, from one
// row.

#include <torch/extension.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t kBlock = 16;  // outputs per block: one register of float32 sums
constexpr int kBlocks = 4;      // blocks per tile of outputs
constexpr int64_t kWidth = kBlocks * kBlock;
constexpr int kMaxRows = 6;     // rows per tile: 6 x 4 sums, 4 weight vectors and a broadcast in 32 registers

#if defined(__AVX512BF16__)
constexpr bool kAvailable = true;

// Rows x 64 outputs: sums over every input pair in order, then bias and rounding; the first ``valid`` outputs
// are stored.
template <int Rows>
inline void tile(const uint16_t* const* inputs, const uint16_t* weights, int64_t pairs, const uint16_t* bias,
                 uint16_t* const* outputs, int64_t valid) {
    __m512 sums[Rows][kBlocks];
    for (int r = 0; r < Rows; ++r)
        for (int b = 0; b < kBlocks; ++b) sums[r][b] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; ++p) {
        __m512bh w[kBlocks];
        for (int b = 0; b < kBlocks; ++b)
            w[b] = (__m512bh)_mm512_loadu_si512(weights + (p * kBlocks + b) * 2 * kBlock);
        for (int r = 0; r < Rows; ++r) {
            int32_t pair;
            std::memcpy(&pair, inputs[r] + 2 * p, sizeof(pair));
            const __m512bh x = (__m512bh)_mm512_set1_epi32(pair);
            for (int b = 0; b < kBlocks; ++b) sums[r][b] = _mm512_dpbf16_ps(sums[r][b], w[b], x);
        }
    }
    for (int b = 0; b < kBlocks; ++b) {
        const int64_t left = valid - b * kBlock;
        if (left <= 0) break;
        const __mmask16 mask = left >= kBlock ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
        __m512 added = _mm512_setzero_ps();
        if (bias != nullptr)
            added = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, bias + b * kBlock)), 16));
        for (int r = 0; r < Rows; ++r) {
            const __m512 total = bias != nullptr ? _mm512_add_ps(sums[r][b], added) : sums[r][b];
            _mm256_mask_storeu_epi16(outputs[r] + b * kBlock, mask, (__m256i)_mm512_cvtneps_pbh(total));
        }
    }
}

void any_tile(int rows, const uint16_t* const* inputs, const uint16_t* weights, int64_t pairs, const uint16_t* bias,
              uint16_t* const* outputs, int64_t valid) {
    switch (rows) {
        case 1: tile<1>(inputs, weights, pairs, bias, outputs, valid); break;
        case 2: tile<2>(inputs, weights, pairs, bias, outputs, valid); break;
        case 3: tile<3>(inputs, weights, pairs, bias, outputs, valid); break;
        case 4: tile<4>(inputs, weights, pairs, bias, outputs, valid); break;
        case 5: tile<5>(inputs, weights, pairs, bias, outputs, valid); break;
        default: tile<6>(inputs, weights, pairs, bias, outputs, valid); break;
    }
}
#else
constexpr bool kAvailable = false;
#endif

}  // namespace

bool blocked_linear_available() { return kAvailable; }

// weight: (N, K) bfloat16, K even. Returns (tiles, K / 2, 64, 2), outputs past N zero.
torch::Tensor pack_blocked_weight(const torch::Tensor& weight) {
    TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16, "weight: (out, in) bfloat16");
    const int64_t out = weight.size(0), in = weight.size(1);
    TORCH_CHECK(in % 2 == 0, "an even number of input features");
    const int64_t tiles = (out + kWidth - 1) / kWidth;
    auto padded = weight.new_zeros({tiles * kWidth, in});
    padded.narrow(0, 0, out).copy_(weight);
    return padded.view({tiles, kWidth, in / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

// inputs: (rows, K) bfloat16 with unit column stride; packed: from pack_blocked_weight; bias: (N,) or empty.
// Returns (rows, N).
torch::Tensor blocked_linear(const torch::Tensor& inputs, const torch::Tensor& packed,
                             const c10::optional<torch::Tensor>& bias, int64_t out_features) {
    TORCH_CHECK(kAvailable, "blocked_linear needs a CPU with avx512_bf16 (and a build for it)");
    TORCH_CHECK(inputs.dim() == 2 && inputs.scalar_type() == at::kBFloat16 && inputs.stride(1) == 1,
                "inputs: (rows, in) bfloat16, rows contiguous");
    TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() &&
                    packed.size(2) == kWidth && packed.size(3) == 2,
                "packed: from pack_blocked_weight");
    const int64_t rows = inputs.size(0), in = inputs.size(1), tiles = packed.size(0), pairs = packed.size(1);
    TORCH_CHECK(pairs * 2 == in, "inputs: ", 2 * pairs, " features");
    TORCH_CHECK(out_features > (tiles - 1) * kWidth && out_features <= tiles * kWidth, "out_features: the packing's");
    const uint16_t* bias_data = nullptr;
    if (bias.has_value() && bias->defined()) {
        TORCH_CHECK(bias->dim() == 1 && bias->size(0) == out_features && bias->is_contiguous() &&
                        bias->scalar_type() == at::kBFloat16,
                    "bias: (out,) bfloat16");
        bias_data = reinterpret_cast<const uint16_t*>(bias->data_ptr<at::BFloat16>());
    }
    auto output = torch::empty({rows, out_features}, inputs.options());
#if defined(__AVX512BF16__)
    const uint16_t* x = reinterpret_cast<const uint16_t*>(inputs.data_ptr<at::BFloat16>());
    const uint16_t* w = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
    uint16_t* y = reinterpret_cast<uint16_t*>(output.data_ptr<at::BFloat16>());
    const int64_t x_stride = inputs.stride(0), tile_stride = pairs * 2 * kWidth;
    // Threads take runs of whole tiles; each tile (one contiguous stream of weights) runs over the rows in tiles of
    // six, its weights staying in cache from one row tile to the next.
    at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
        const uint16_t* row_inputs[kMaxRows];
        uint16_t* row_outputs[kMaxRows];
        for (int64_t t = begin; t < end; ++t) {
            const int64_t column = t * kWidth;
            const int64_t valid = std::min<int64_t>(kWidth, out_features - column);
            for (int64_t row = 0; row < rows; row += kMaxRows) {
                const int tile_rows = static_cast<int>(std::min<int64_t>(kMaxRows, rows - row));
                for (int r = 0; r < tile_rows; ++r) {
                    row_inputs[r] = x + (row + r) * x_stride;
                    row_outputs[r] = y + (row + r) * out_features + column;
                }
                any_tile(tile_rows, row_inputs, w + t * tile_stride, pairs,
                         bias_data == nullptr ? nullptr : bias_data + column, row_outputs, valid);
            }
        }
    });
#endif
    return output;
}
