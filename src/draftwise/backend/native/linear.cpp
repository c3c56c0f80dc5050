// Linear products (y = x W^T + b) from weights packed once into tiles of 64 outputs, on CPUs with AVX-512: float32
// weights (fused multiply-adds) and, with avx512_bf16, bfloat16 weights (vdpbf16ps).
//
// Packed layout: (ceil(N / 64), K / e, 64, e), e = 2 for bfloat16 and 1 for float32: tile t holds outputs 64t ..
// 64t + 63 (zero weights past N) and, for each step of e inputs, four 64-byte vectors of their weights, one per block
// of sixteen outputs. A row's sixteen outputs of a block are one register of sums, updated with the row's broadcast
// inputs: no horizontal sums, each weight read from memory once a call, each tile one contiguous stream.
//
// Every output is one float32 sum over the input steps in order 0, 1, 2, ..., then the bias (and, for bfloat16, one
// rounding to nearest even), by the same instruction sequence whichever tile of rows it falls in and whether the steps
// run in one pass or in chunks (the sums wait in memory as float32), so a row's bits never depend on how many rows
// the call holds: these products are batch invariant by construction, from one row.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Optional.h>
#if defined(__x86_64__) || defined(_M_X64) || defined(__i386__) || defined(_M_IX86)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace {

constexpr int64_t kBlock = 16;  // outputs per block: one register of float32 sums
constexpr int kBlocks = 4;      // blocks per tile of outputs
constexpr int64_t kWidth = kBlocks * kBlock;
constexpr int kMaxRows = 6;     // rows per tile: 6 x 4 sums, 4 weight vectors and a broadcast in 32 registers

// The element types: how a step of inputs is broadcast, how sums are updated and how results are stored.
struct Bfloat16Step {
    using element = uint16_t;
    static constexpr int64_t kPerStep = 2;
#if defined(__AVX512BF16__)
    static constexpr bool kAvailable = true;
    static __m512 broadcast(const element* inputs) {
        int32_t pair;
        std::memcpy(&pair, inputs, sizeof(pair));
        return _mm512_castsi512_ps(_mm512_set1_epi32(pair));
    }
    static __m512 multiply_add(__m512 sums, __m512 weights, __m512 inputs) {
        return _mm512_dpbf16_ps(sums, (__m512bh)weights, (__m512bh)inputs);
    }
    static __m512 load_bias(const element* bias, __mmask16 mask) {
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, bias)), 16));
    }
    static void store(element* out, __mmask16 mask, __m512 values) {
        _mm256_mask_storeu_epi16(out, mask, (__m256i)_mm512_cvtneps_pbh(values));
    }
#else
    static constexpr bool kAvailable = false;
#endif
};

struct Float32Step {
    using element = float;
    static constexpr int64_t kPerStep = 1;
#if defined(__AVX512F__)
    static constexpr bool kAvailable = true;
    static __m512 broadcast(const element* inputs) { return _mm512_set1_ps(*inputs); }
    static __m512 multiply_add(__m512 sums, __m512 weights, __m512 inputs) {
        return _mm512_fmadd_ps(weights, inputs, sums);
    }
    static __m512 load_bias(const element* bias, __mmask16 mask) { return _mm512_maskz_loadu_ps(mask, bias); }
    static void store(element* out, __mmask16 mask, __m512 values) { _mm512_mask_storeu_ps(out, mask, values); }
#else
    static constexpr bool kAvailable = false;
#endif
};

#if defined(__AVX512F__)
// Rows x 64 outputs over input steps [0, steps): the sums start at zero (kFirst) or from ``partial``; after the last
// steps (kLast) bias and rounding, and the first ``valid`` outputs are stored, else the sums go back to ``partial``.
// Sums leave the registers as float32 and come back unchanged, so splitting the steps changes no bit. ``ahead``, where
// given, is prefetched step by step: the weights the next call will read.
template <typename Step, int Rows, bool kFirst, bool kLast>
inline void tile(const typename Step::element* const* inputs, const typename Step::element* weights, int64_t steps,
                 __m512* partial, const typename Step::element* ahead, const typename Step::element* bias,
                 typename Step::element* const* outputs, int64_t valid) {
    constexpr int64_t kStepWidth = kWidth * Step::kPerStep;  // elements of one step's weights
    __m512 sums[Rows][kBlocks];
    for (int r = 0; r < Rows; ++r)
        for (int b = 0; b < kBlocks; ++b) sums[r][b] = kFirst ? _mm512_setzero_ps() : partial[r * kBlocks + b];
    for (int64_t p = 0; p < steps; ++p) {
        __m512 w[kBlocks];
        for (int b = 0; b < kBlocks; ++b)
            w[b] = _mm512_castsi512_ps(_mm512_loadu_si512(weights + p * kStepWidth + b * kBlock * Step::kPerStep));
        if (ahead != nullptr)
            for (int b = 0; b < kBlocks; ++b)
                _mm_prefetch(reinterpret_cast<const char*>(ahead + p * kStepWidth + b * kBlock * Step::kPerStep),
                             _MM_HINT_T0);
        for (int r = 0; r < Rows; ++r) {
            const __m512 x = Step::broadcast(inputs[r] + p * Step::kPerStep);
            for (int b = 0; b < kBlocks; ++b) sums[r][b] = Step::multiply_add(sums[r][b], w[b], x);
        }
    }
    if (!kLast) {
        for (int r = 0; r < Rows; ++r)
            for (int b = 0; b < kBlocks; ++b) partial[r * kBlocks + b] = sums[r][b];
        return;
    }
    for (int b = 0; b < kBlocks; ++b) {
        const int64_t left = valid - b * kBlock;
        if (left <= 0) break;
        const __mmask16 mask = left >= kBlock ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
        const __m512 added = bias != nullptr ? Step::load_bias(bias + b * kBlock, mask) : _mm512_setzero_ps();
        for (int r = 0; r < Rows; ++r)
            Step::store(outputs[r] + b * kBlock, mask, bias != nullptr ? _mm512_add_ps(sums[r][b], added) : sums[r][b]);
    }
}

template <typename Step, bool kFirst, bool kLast>
void any_tile(int rows, const typename Step::element* const* inputs, const typename Step::element* weights,
              int64_t steps, __m512* partial, const typename Step::element* ahead, const typename Step::element* bias,
              typename Step::element* const* outputs, int64_t valid) {
    switch (rows) {
        case 1: tile<Step, 1, kFirst, kLast>(inputs, weights, steps, partial, ahead, bias, outputs, valid); break;
        case 2: tile<Step, 2, kFirst, kLast>(inputs, weights, steps, partial, ahead, bias, outputs, valid); break;
        case 3: tile<Step, 3, kFirst, kLast>(inputs, weights, steps, partial, ahead, bias, outputs, valid); break;
        case 4: tile<Step, 4, kFirst, kLast>(inputs, weights, steps, partial, ahead, bias, outputs, valid); break;
        case 5: tile<Step, 5, kFirst, kLast>(inputs, weights, steps, partial, ahead, bias, outputs, valid); break;
        default: tile<Step, 6, kFirst, kLast>(inputs, weights, steps, partial, ahead, bias, outputs, valid); break;
    }
}

// any_tile for a chunk of the steps: whether it is the first (sums from zero) and the last (outputs stored).
// (Branches, not a pointer to one of the four: an indirect call per chunk measured 3-7% slower.)
template <typename Step>
inline void any_chunk_tile(bool first, bool last, int rows, const typename Step::element* const* inputs,
                           const typename Step::element* weights, int64_t steps, __m512* partial,
                           const typename Step::element* ahead, const typename Step::element* bias,
                           typename Step::element* const* outputs, int64_t valid) {
    if (first && last)
        any_tile<Step, true, true>(rows, inputs, weights, steps, partial, ahead, bias, outputs, valid);
    else if (first)
        any_tile<Step, true, false>(rows, inputs, weights, steps, partial, ahead, bias, outputs, valid);
    else if (last)
        any_tile<Step, false, true>(rows, inputs, weights, steps, partial, ahead, bias, outputs, valid);
    else
        any_tile<Step, false, false>(rows, inputs, weights, steps, partial, ahead, bias, outputs, valid);
}

// Threads take runs of whole tiles; each tile (one contiguous stream of weights) runs over the rows in tiles of six,
// its weights staying in cache from one row tile to the next. For one row, and for many rows, whose arithmetic
// outweighs the reading.
template <typename Step>
void product(const typename Step::element* x, int64_t x_stride, int64_t rows, const typename Step::element* w,
             int64_t tiles, int64_t steps, const typename Step::element* bias, typename Step::element* y,
             int64_t out_features) {
    using element = typename Step::element;
    const int64_t tile_stride = steps * kWidth * Step::kPerStep;
    at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
        const element* row_inputs[kMaxRows];
        element* row_outputs[kMaxRows];
        for (int64_t t = begin; t < end; ++t) {
            const int64_t column = t * kWidth;
            const int64_t valid = std::min<int64_t>(kWidth, out_features - column);
            for (int64_t row = 0; row < rows; row += kMaxRows) {
                const int tile_rows = static_cast<int>(std::min<int64_t>(kMaxRows, rows - row));
                for (int r = 0; r < tile_rows; ++r) {
                    row_inputs[r] = x + (row + r) * x_stride;
                    row_outputs[r] = y + (row + r) * out_features + column;
                }
                any_tile<Step, true, true>(tile_rows, row_inputs, w + t * tile_stride, steps, nullptr, nullptr,
                                           bias == nullptr ? nullptr : bias + column, row_outputs, valid);
            }
        }
    });
}

// Input steps of a chunk: 8 KB of weights (bfloat16 or float32), a few chunks in the first level of cache.
constexpr int64_t kChunkSteps = 32;
// Up to this many rows run chunk by chunk (product_in_chunks); past it the arithmetic outweighs the reading, and the
// sums' round trips through memory cost more than they save (measured, bfloat16, SmolLM2-135M's products streamed
// from memory: chunked, 20-32 rows took 5-13% less time than one pass per tile of rows, 48-64 rows 2-4% more).
constexpr int64_t kMostChunkedRows = 32;

// A few rows, a tile's weights taken in chunks of input steps: every tile of six rows runs over a chunk before the
// next is read, and the next is prefetched meanwhile, so the weights stream from memory once, under the arithmetic
// of all the rows, where one pass per tile of rows would read them again from the second level of cache after
// memory went idle. (The products of SmolLM2-135M, bfloat16: six rows cost 1.1x one row this way, twelve 1.4x; one
// pass per six rows: 1.15x and 1.7x.)
template <typename Step>
void product_in_chunks(const typename Step::element* x, int64_t x_stride, int64_t rows,
                       const typename Step::element* w, int64_t tiles, int64_t steps,
                       const typename Step::element* bias, typename Step::element* y, int64_t out_features) {
    using element = typename Step::element;
    constexpr int64_t kChunkWidth = kChunkSteps * kWidth * Step::kPerStep;  // elements of one chunk's weights
    const int64_t tile_stride = steps * kWidth * Step::kPerStep;
    at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
        const element* row_inputs[kMaxRows];
        element* row_outputs[kMaxRows];
        __m512 partial[kMostChunkedRows * kBlocks];
        for (int64_t t = begin; t < end; ++t) {
            const int64_t column = t * kWidth;
            const int64_t valid = std::min<int64_t>(kWidth, out_features - column);
            for (int64_t start = 0; start < steps; start += kChunkSteps) {
                const int64_t chunk_steps = std::min<int64_t>(kChunkSteps, steps - start);
                const bool first = start == 0, last = start + chunk_steps == steps;
                const element* weights = w + t * tile_stride + start * kWidth * Step::kPerStep;
                // The next chunk (this tile's or the next tile's first), fetched by the first tile of rows.
                const element* ahead = !last || t + 1 < end ? weights + kChunkWidth : nullptr;
                for (int64_t row = 0; row < rows; row += kMaxRows) {
                    const int tile_rows = static_cast<int>(std::min<int64_t>(kMaxRows, rows - row));
                    for (int r = 0; r < tile_rows; ++r) {
                        row_inputs[r] = x + (row + r) * x_stride + start * Step::kPerStep;
                        row_outputs[r] = y + (row + r) * out_features + column;
                    }
                    any_chunk_tile<Step>(first, last, tile_rows, row_inputs, weights, chunk_steps,
                                         partial + row * kBlocks, row == 0 ? ahead : nullptr,
                                         bias == nullptr ? nullptr : bias + column, row_outputs, valid);
                }
            }
        }
    });
}
#endif

bool runs(at::ScalarType dtype) {
    return (dtype == at::kBFloat16 && Bfloat16Step::kAvailable) || (dtype == at::kFloat && Float32Step::kAvailable);
}

// Inputs per step of the packed layout (e above) for weights of ``dtype``.
int64_t inputs_per_step(at::ScalarType dtype) {
    return dtype == at::kBFloat16 ? Bfloat16Step::kPerStep : Float32Step::kPerStep;
}

}  // namespace

// The dtypes blocked_linear runs on this machine (by name).
std::vector<std::string> blocked_linear_dtypes() {
    std::vector<std::string> names;
    if (runs(at::kFloat)) names.push_back("float32");
    if (runs(at::kBFloat16)) names.push_back("bfloat16");
    return names;
}

// weight: (N, K) float32 or bfloat16 (K even). Returns the packed layout above (outputs past N zero).
at::Tensor pack_blocked_weight(const at::Tensor& weight) {
    TORCH_CHECK(weight.dim() == 2 && (weight.scalar_type() == at::kBFloat16 || weight.scalar_type() == at::kFloat),
                "weight: (out, in) float32 or bfloat16");
    const int64_t per_step = inputs_per_step(weight.scalar_type());
    const int64_t out = weight.size(0), in = weight.size(1);
    TORCH_CHECK(in % per_step == 0, "an even number of input features");
    const int64_t tiles = (out + kWidth - 1) / kWidth;
    auto padded = weight.new_zeros({tiles * kWidth, in});
    padded.narrow(0, 0, out).copy_(weight);
    return padded.view({tiles, kWidth, in / per_step, per_step}).permute({0, 2, 1, 3}).contiguous();
}

// inputs: (rows, K) in the packing's dtype, unit column stride; packed: from pack_blocked_weight; bias: (N,) or
// empty. Returns (rows, N).
at::Tensor blocked_linear(const at::Tensor& inputs, const at::Tensor& packed,
                          const c10::optional<at::Tensor>& bias, int64_t out_features) {
    const auto dtype = packed.scalar_type();
    TORCH_CHECK(runs(dtype), "blocked_linear does not run ", dtype, " on this machine");
    TORCH_CHECK(inputs.dim() == 2 && inputs.scalar_type() == dtype && inputs.stride(1) == 1,
                "inputs: (rows, in) in the weights' dtype, rows contiguous");
    const int64_t per_step = inputs_per_step(dtype);
    TORCH_CHECK(packed.dim() == 4 && packed.is_contiguous() && packed.size(2) == kWidth && packed.size(3) == per_step,
                "packed: from pack_blocked_weight");
    const int64_t rows = inputs.size(0), in = inputs.size(1), tiles = packed.size(0), steps = packed.size(1);
    TORCH_CHECK(steps * per_step == in, "inputs: ", steps * per_step, " features");
    TORCH_CHECK(out_features > (tiles - 1) * kWidth && out_features <= tiles * kWidth, "out_features: the packing's");
    const bool biased = bias.has_value() && bias->defined();
    if (biased)
        TORCH_CHECK(bias->dim() == 1 && bias->size(0) == out_features && bias->is_contiguous() &&
                        bias->scalar_type() == dtype,
                    "bias: (out,) in the weights' dtype");
    auto output = at::empty({rows, out_features}, inputs.options());
#if defined(__AVX512F__)
    const bool chunked = rows > 1 && rows <= kMostChunkedRows;
    if (dtype == at::kFloat) {
        const auto run = chunked ? product_in_chunks<Float32Step> : product<Float32Step>;
        run(inputs.data_ptr<float>(), inputs.stride(0), rows, packed.data_ptr<float>(), tiles, steps,
            biased ? bias->data_ptr<float>() : nullptr, output.data_ptr<float>(), out_features);
    } else {
#if defined(__AVX512BF16__)
        auto raw = [](const at::Tensor& tensor) { return reinterpret_cast<uint16_t*>(tensor.data_ptr<at::BFloat16>()); };
        const auto run = chunked ? product_in_chunks<Bfloat16Step> : product<Bfloat16Step>;
        run(raw(inputs), inputs.stride(0), rows, raw(packed), tiles, steps, biased ? raw(*bias) : nullptr, raw(output),
            out_features);
#endif
    }
#endif
    return output;
}
