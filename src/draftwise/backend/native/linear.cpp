// Linear products (y = x W^T + b) from weights packed once into tiles of 64 outputs, on CPUs with AVX-512: float32
// weights (fused multiply-adds) and, with avx512_bf16, bfloat16 weights (vdpbf16ps); on CPUs with AVX2 and FMA (no
// AVX-512), float32 and bfloat16 weights widened to float32 in registers (namespace avx2).
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

#include "kernels.h"

namespace {

constexpr int64_t kBlock = 16;  // outputs per block: one register of float32 sums
constexpr int kBlocks = 4;      // blocks per tile of outputs
constexpr int64_t kWidth = kBlocks * kBlock;
constexpr int kMaxRows = 6;     // rows per tile: 6 x 4 sums, 4 weight vectors and a broadcast in 32 registers
// Input steps of a chunk: 8 KB of weights (bfloat16 or float32), a few chunks in the first level of cache.
constexpr int64_t kChunkSteps = 32;

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

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
// CPUs with AVX2 and FMA but not AVX-512: the same packed layout and the same order of every sum, eight outputs a
// register, inputs as float32 (bfloat16 inputs are widened once a call). Sixteen registers hold fewer sums than
// AVX-512's 32, so a tile of 64 outputs runs in passes over groups of its eight blocks: one row takes all eight blocks a
// pass (eight independent sums keep the multiply-adds busy), two rows four, three to six rows two (up to 6 x 2 sums, the
// usual AVX2 matrix kernel's shape). Each output's sum runs over the steps in order with one multiply-add a weight,
// whichever pass holds it. Several rows take the weights chunk by chunk, as product_in_chunks does.
namespace avx2 {

constexpr int kLanes = 8;
constexpr int kTileBlocks = static_cast<int>(kWidth / kLanes);
constexpr int kGroupRows = 4;

inline __m256i lane_mask(int count) {  // the first ``count`` of eight lanes
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(count), lanes);
}

inline float widen(uint16_t half) {
    const uint32_t bits = static_cast<uint32_t>(half) << 16;
    float value;
    std::memcpy(&value, &bits, sizeof(value));
    return value;
}

struct Float32 {
    using element = float;
    static constexpr int64_t kPerStep = 1;
    template <int Rows, int Blocks>
    static inline void step(const element* weights, const float* const* inputs, int64_t p, __m256 (&sums)[Rows][Blocks]) {
        for (int b = 0; b < Blocks; ++b) {
            const __m256 w = _mm256_loadu_ps(weights + b * kLanes);
            for (int r = 0; r < Rows; ++r)
                sums[r][b] = _mm256_fmadd_ps(w, _mm256_broadcast_ss(inputs[r] + p), sums[r][b]);
        }
    }
    static __m256 load_bias(const element* bias, int count) {
        return count == kLanes ? _mm256_loadu_ps(bias) : _mm256_maskload_ps(bias, lane_mask(count));
    }
    static void store(element* out, int count, __m256 values) {
        if (count == kLanes)
            _mm256_storeu_ps(out, values);
        else
            _mm256_maskstore_ps(out, lane_mask(count), values);
    }
};

// bfloat16 weights: a step is a pair of inputs, and a block's weights of a step one 256-bit load of eight (first,
// second) pairs: the first weights are the pairs' low halves shifted up, the second their high halves.
struct Bfloat16 {
    using element = uint16_t;
    static constexpr int64_t kPerStep = 2;
    template <int Rows, int Blocks>
    static inline void step(const element* weights, const float* const* inputs, int64_t p, __m256 (&sums)[Rows][Blocks]) {
        __m256 first[Rows], second[Rows];  // (broadcast once a step for every block)
        for (int r = 0; r < Rows; ++r) {
            first[r] = _mm256_broadcast_ss(inputs[r] + 2 * p);
            second[r] = _mm256_broadcast_ss(inputs[r] + 2 * p + 1);
        }
        const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
        for (int b = 0; b < Blocks; ++b) {
            const __m256i pairs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(weights + b * kLanes * 2));
            const __m256 w_first = _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16));
            const __m256 w_second = _mm256_castsi256_ps(_mm256_and_si256(pairs, high));
            for (int r = 0; r < Rows; ++r) {
                sums[r][b] = _mm256_fmadd_ps(w_first, first[r], sums[r][b]);
                sums[r][b] = _mm256_fmadd_ps(w_second, second[r], sums[r][b]);
            }
        }
    }
    static __m256 load_bias(const element* bias, int count) {
        alignas(32) float values[kLanes] = {};
        for (int i = 0; i < count; ++i) values[i] = widen(bias[i]);
        return _mm256_load_ps(values);
    }
    static void store(element* out, int count, __m256 values) {  // rounded to nearest even, a NaN kept a NaN
        alignas(32) uint32_t bits[kLanes];
        _mm256_store_si256(reinterpret_cast<__m256i*>(bits), _mm256_castps_si256(values));
        for (int i = 0; i < count; ++i) {
            const uint32_t b = bits[i];
            out[i] = (b & 0x7FFFFFFFu) > 0x7F800000u ? static_cast<uint16_t>((b >> 16) | 0x40u)
                                                     : static_cast<uint16_t>((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
        }
    }
};

// Rows x (8 Blocks) outputs over ``steps`` input steps: sums from zero (first) or ``partial`` (row stride kWidth);
// after the last steps bias, rounding and the first ``valid`` outputs stored, else the sums back to ``partial``.
template <typename S, int Rows, int Blocks>
void pass(const float* const* inputs, const typename S::element* weights, int64_t steps, float* partial, bool first,
          bool last, const typename S::element* bias, typename S::element* const* outputs, int64_t valid) {
    __m256 sums[Rows][Blocks];
    for (int r = 0; r < Rows; ++r)
        for (int b = 0; b < Blocks; ++b)
            sums[r][b] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(partial + r * kWidth + b * kLanes);
    for (int64_t p = 0; p < steps; ++p)
        S::template step<Rows, Blocks>(weights + p * kWidth * S::kPerStep, inputs, p, sums);
    if (!last) {
        for (int r = 0; r < Rows; ++r)
            for (int b = 0; b < Blocks; ++b) _mm256_storeu_ps(partial + r * kWidth + b * kLanes, sums[r][b]);
        return;
    }
    for (int b = 0; b < Blocks; ++b) {
        const int64_t left = valid - b * kLanes;
        if (left <= 0) break;
        const int count = static_cast<int>(std::min<int64_t>(kLanes, left));
        const __m256 added = bias != nullptr ? S::load_bias(bias + b * kLanes, count) : _mm256_setzero_ps();
        for (int r = 0; r < Rows; ++r)
            S::store(outputs[r] + b * kLanes, count, bias != nullptr ? _mm256_add_ps(sums[r][b], added) : sums[r][b]);
    }
}

// One group of up to six rows over a tile's chunk, in passes over groups of blocks (see above).
template <typename S, int Rows>
void group(const float* const* inputs, const typename S::element* weights, int64_t steps, float* partial, bool first,
           bool last, const typename S::element* bias, typename S::element* const* outputs, int64_t valid) {
    constexpr int kBlocksPerPass = Rows == 1 ? 8 : Rows == 2 ? 4 : 2;
    typename S::element* shifted[Rows];
    for (int block = 0; block < kTileBlocks && block * kLanes < valid; block += kBlocksPerPass) {
        const int64_t column = block * kLanes;
        for (int r = 0; r < Rows; ++r) shifted[r] = outputs[r] + column;
        pass<S, Rows, kBlocksPerPass>(inputs, weights + column * S::kPerStep, steps,
                                      partial == nullptr ? nullptr : partial + column, first, last,
                                      bias == nullptr ? nullptr : bias + column, shifted, valid - column);
    }
}

// ``x``: the inputs as float32, rows ``x_stride`` apart.
template <typename S>
void product(const float* x, int64_t x_stride, int64_t rows, const typename S::element* w, int64_t tiles,
             int64_t steps, const typename S::element* bias, typename S::element* y, int64_t out_features) {
    using element = typename S::element;
    const int64_t tile_stride = steps * kWidth * S::kPerStep;
    const int64_t chunk = rows == 1 ? steps : kChunkSteps;  // one row has no other rows to keep a chunk in cache for
    at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
        std::vector<float> partial(steps > chunk ? rows * kWidth : 0);
        const float* row_inputs[kGroupRows];
        element* row_outputs[kGroupRows];
        for (int64_t t = begin; t < end; ++t) {
            const int64_t column = t * kWidth;
            const int64_t valid = std::min<int64_t>(kWidth, out_features - column);
            for (int64_t start = 0; start < steps; start += chunk) {
                const int64_t chunk_steps = std::min<int64_t>(chunk, steps - start);
                const bool first = start == 0, last = start + chunk_steps == steps;
                const element* weights = w + t * tile_stride + start * kWidth * S::kPerStep;
                for (int64_t row = 0; row < rows; row += kGroupRows) {
                    const int group_rows = static_cast<int>(std::min<int64_t>(kGroupRows, rows - row));
                    for (int r = 0; r < group_rows; ++r) {
                        row_inputs[r] = x + (row + r) * x_stride + start * S::kPerStep;
                        row_outputs[r] = y + (row + r) * out_features + column;
                    }
                    float* sums = partial.empty() ? nullptr : partial.data() + row * kWidth;
                    const element* offset = bias == nullptr ? nullptr : bias + column;
                    switch (group_rows) {
                        case 1: group<S, 1>(row_inputs, weights, chunk_steps, sums, first, last, offset, row_outputs, valid); break;
                        case 2: group<S, 2>(row_inputs, weights, chunk_steps, sums, first, last, offset, row_outputs, valid); break;
                        case 3: group<S, 3>(row_inputs, weights, chunk_steps, sums, first, last, offset, row_outputs, valid); break;
                        case 4: group<S, 4>(row_inputs, weights, chunk_steps, sums, first, last, offset, row_outputs, valid); break;
                        case 5: group<S, 5>(row_inputs, weights, chunk_steps, sums, first, last, offset, row_outputs, valid); break;
                        default: group<S, 6>(row_inputs, weights, chunk_steps, sums, first, last, offset, row_outputs, valid); break;
                    }
                }
            }
        }
    });
}

// The bfloat16 inputs (rows, in) widened to float32 once, for every tile's passes.
inline std::vector<float> widened(const uint16_t* x, int64_t x_stride, int64_t rows, int64_t in) {
    std::vector<float> wide(rows * in);
    for (int64_t row = 0; row < rows; ++row)
        for (int64_t i = 0; i < in; ++i) wide[row * in + i] = widen(x[row * x_stride + i]);
    return wide;
}

}  // namespace avx2
#endif

bool runs(at::ScalarType dtype) {
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
    return dtype == at::kBFloat16 || dtype == at::kFloat;
#else
    return (dtype == at::kBFloat16 && Bfloat16Step::kAvailable) || (dtype == at::kFloat && Float32Step::kAvailable);
#endif
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

namespace {

// The checks of a product's arguments (before its output is allocated).
void check_blocked_product(const at::Tensor& inputs, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                           int64_t out_features) {
    const auto dtype = packed.scalar_type();
    TORCH_CHECK(runs(dtype), "blocked_linear does not run ", dtype, " on this machine");
    TORCH_CHECK(inputs.dim() == 2 && inputs.scalar_type() == dtype && inputs.stride(1) == 1,
                "inputs: (rows, in) in the weights' dtype, rows contiguous");
    const int64_t per_step = inputs_per_step(dtype);
    TORCH_CHECK(packed.dim() == 4 && packed.is_contiguous() && packed.size(2) == kWidth && packed.size(3) == per_step,
                "packed: from pack_blocked_weight");
    const int64_t tiles = packed.size(0);
    TORCH_CHECK(packed.size(1) * per_step == inputs.size(1), "inputs: ", packed.size(1) * per_step, " features");
    TORCH_CHECK(out_features > (tiles - 1) * kWidth && out_features <= tiles * kWidth, "out_features: the packing's");
    if (bias.has_value() && bias->defined())
        TORCH_CHECK(bias->dim() == 1 && bias->size(0) == out_features && bias->is_contiguous() &&
                        bias->scalar_type() == dtype,
                    "bias: (out,) in the weights' dtype");
}

}  // namespace

// inputs: (rows, K) in the packing's dtype, unit column stride; packed: from pack_blocked_weight; bias: (N,) or
// empty. Returns (rows, N).
at::Tensor blocked_linear(const at::Tensor& inputs, const at::Tensor& packed,
                          const c10::optional<at::Tensor>& bias, int64_t out_features) {
    check_blocked_product(inputs, packed, bias, out_features);
    auto output = at::empty({inputs.size(0), out_features}, inputs.options());
    blocked_linear_into(inputs, packed, bias, out_features, output);
    return output;
}

void blocked_linear_into(const at::Tensor& inputs, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                         int64_t out_features, const at::Tensor& output) {
    check_blocked_product(inputs, packed, bias, out_features);
    const auto dtype = packed.scalar_type();
    const int64_t rows = inputs.size(0), in = inputs.size(1), tiles = packed.size(0), steps = packed.size(1);
    const bool biased = bias.has_value() && bias->defined();
    check_output_rows(output, rows, out_features, dtype, "output");
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
#elif defined(__AVX2__) && defined(__FMA__)
    if (dtype == at::kFloat) {
        avx2::product<avx2::Float32>(inputs.data_ptr<float>(), inputs.stride(0), rows, packed.data_ptr<float>(), tiles,
                                     steps, biased ? bias->data_ptr<float>() : nullptr, output.data_ptr<float>(),
                                     out_features);
    } else {
        auto raw = [](const at::Tensor& tensor) { return reinterpret_cast<uint16_t*>(tensor.data_ptr<at::BFloat16>()); };
        const auto wide = avx2::widened(raw(inputs), inputs.stride(0), rows, in);
        avx2::product<avx2::Bfloat16>(wide.data(), in, rows, raw(packed), tiles, steps, biased ? raw(*bias) : nullptr,
                                      raw(output), out_features);
    }
#endif
}
