// Linear products (y = x W^T + b, float32 rows) over weights kept in GGUF's block quantisations, in the common form
// draftwise.backend.weights.quantized decodes every type to (weight = scale * quant + offset, scale * quant exact in
// float32) and repacks once into tiles of 64 outputs:
//
//   (tiles, groups, bytes): for each tile of 64 outputs and each group of 32 inputs, the 64 outputs' scales as float32
//   (two rows of them, for inputs 0-15 and 16-31, with kHalves), their offsets as float32 (with kOffsets), then the
//   group's quants input by input: 64 int8 (output o at byte o), or with kNibbles 32 bytes (output o in the low nibble
//   of byte o, output o + 32 in the high one; the quant is the nibble - 8 with kCentred).
//
// A tile's group is dequantised once a call into a float32 buffer (8 KB, in the first level of cache) for all the rows
// of the call: each weight is scale * quant (exact) + offset (one rounding), the very value gguf's own dequantisation
// gives. Then every output is one float32 sum over the inputs in order 0, 1, 2, ... with one fused multiply-add a
// weight, then the bias: blocked_linear's float32 arithmetic on the dequantised matrix, bit for bit, whatever the
// number of rows, on any CPU (the fallback without AVX2 and FMA computes the same fused multiply-adds one at a time).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Optional.h>
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels.h"

// (a namespace of its own: the vector sources are also compiled as one unit, beside linear.cpp's helpers)
namespace quantized_products {

constexpr int64_t kWidth = 64;  // outputs per tile
constexpr int64_t kGroup = 32;  // inputs per quantisation block
constexpr int64_t kRowsPerGroup = 4;

enum Format : int64_t { kNibbles = 1, kOffsets = 2, kHalves = 4, kCentred = 8 };

bool valid_format(int64_t format) {
    return format >= 0 && format < 16 && ((format & kCentred) == 0 || (format & kNibbles) != 0);
}

int64_t group_bytes(int64_t format) {
    const int64_t scales = (format & kHalves ? 2 : 1) * kWidth * static_cast<int64_t>(sizeof(float));
    const int64_t offsets = format & kOffsets ? kWidth * static_cast<int64_t>(sizeof(float)) : 0;
    return scales + offsets + (format & kNibbles ? kGroup * kWidth / 2 : kGroup * kWidth);
}

#if defined(__AVX2__)
// A packed group read directly: the weights of eight outputs computed in registers (scale * quant, then + offset).
// dequantize_group stores them in the group buffer; calls of a few rows, which would each use a buffered value once,
// use them at once.
template <bool Nibbles, bool Offsets, bool Halves>
struct InRegisters {
    // Nibbles: outputs o and o + 32 share their bytes, so a pass over all 64 outputs reads each byte once.
    static constexpr bool kPairs = Nibbles;
    const float* scales;
    const float* offsets;
    const uint8_t* quants;
    __m256i centre;

    InRegisters(const uint8_t* source, int centre_by)
        : scales(reinterpret_cast<const float*>(source)),
          offsets(scales + (Halves ? 2 : 1) * kWidth),
          quants(source + ((Halves ? 2 : 1) + (Offsets ? 1 : 0)) * kWidth * static_cast<int64_t>(sizeof(float))),
          centre(_mm256_set1_epi32(centre_by)) {}

    __m256 at(int64_t p, int64_t o) const {
        __m256i quant;
        if (Nibbles) {
            const __m256i bytes = _mm256_cvtepu8_epi32(
                _mm_loadl_epi64(reinterpret_cast<const __m128i*>(quants + p * (kWidth / 2) + o % (kWidth / 2))));
            quant = o < kWidth / 2 ? _mm256_and_si256(bytes, _mm256_set1_epi32(15)) : _mm256_srli_epi32(bytes, 4);
            quant = _mm256_sub_epi32(quant, centre);
        } else {
            quant = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(quants + p * kWidth + o)));
        }
        __m256 value = _mm256_mul_ps(_mm256_loadu_ps(scales + (Halves && p >= kGroup / 2 ? kWidth : 0) + o),
                                     _mm256_cvtepi32_ps(quant));
        if (Offsets) value = _mm256_add_ps(value, _mm256_loadu_ps(offsets + o));
        return value;
    }

    // The weights of outputs o..o+7 (o < 32, their low nibbles) and o+32..o+39 (the high ones).
    void pair(int64_t p, int64_t o, __m256& first, __m256& second) const {
        const __m256i bytes = _mm256_cvtepu8_epi32(
            _mm_loadl_epi64(reinterpret_cast<const __m128i*>(quants + p * (kWidth / 2) + o)));
        const __m256i low = _mm256_sub_epi32(_mm256_and_si256(bytes, _mm256_set1_epi32(15)), centre);
        const __m256i high = _mm256_sub_epi32(_mm256_srli_epi32(bytes, 4), centre);
        const float* scale = scales + (Halves && p >= kGroup / 2 ? kWidth : 0);
        first = _mm256_mul_ps(_mm256_loadu_ps(scale + o), _mm256_cvtepi32_ps(low));
        second = _mm256_mul_ps(_mm256_loadu_ps(scale + o + kWidth / 2), _mm256_cvtepi32_ps(high));
        if (Offsets) {
            first = _mm256_add_ps(first, _mm256_loadu_ps(offsets + o));
            second = _mm256_add_ps(second, _mm256_loadu_ps(offsets + o + kWidth / 2));
        }
    }
};
#endif

// One tile's group of 32 inputs as float32 weights, [input][output]: scale * quant (exact) + offset.
template <bool Nibbles, bool Offsets, bool Halves>
void dequantize_group(const uint8_t* source, int centre, float* out) {
#if defined(__AVX2__)
    const InRegisters<Nibbles, Offsets, Halves> weights(source, centre);
    for (int64_t p = 0; p < kGroup; ++p) {
        float* row = out + p * kWidth;
        if (Nibbles) {
            for (int64_t o = 0; o < kWidth / 2; o += 8) {
                __m256 first, second;
                weights.pair(p, o, first, second);
                _mm256_storeu_ps(row + o, first);
                _mm256_storeu_ps(row + o + kWidth / 2, second);
            }
        } else {
            for (int64_t o = 0; o < kWidth; o += 8) _mm256_storeu_ps(row + o, weights.at(p, o));
        }
    }
#else
    constexpr int64_t kScaleRows = Halves ? 2 : 1;
    float scales[kScaleRows][kWidth];
    float offsets[kWidth];
    std::memcpy(scales, source, sizeof(scales));
    if (Offsets) std::memcpy(offsets, source + sizeof(scales), sizeof(offsets));
    const uint8_t* quants = source + sizeof(scales) + (Offsets ? sizeof(offsets) : 0);
    constexpr int64_t kHalf = kWidth / 2;
    for (int64_t p = 0; p < kGroup; ++p) {
        const float* scale = scales[Halves && p >= kGroup / 2 ? 1 : 0];
        for (int64_t o = 0; o < kWidth; ++o) {
            int quant;
            if (Nibbles) {
                const uint8_t byte = quants[p * kHalf + o % kHalf];
                quant = static_cast<int>(o < kHalf ? byte & 15 : byte >> 4) - centre;
            } else {
                quant = static_cast<int8_t>(quants[p * kWidth + o]);
            }
            const float product = scale[o] * static_cast<float>(quant);  // exact: no contraction can change it
            out[p * kWidth + o] = Offsets ? product + offsets[o] : product;
        }
    }
#endif
}

using Dequantizer = void (*)(const uint8_t*, int, float*);

Dequantizer dequantizer(int64_t format) {
    static const Dequantizer table[8] = {
        dequantize_group<false, false, false>, dequantize_group<true, false, false>,
        dequantize_group<false, true, false>,  dequantize_group<true, true, false>,
        dequantize_group<false, false, true>,  dequantize_group<true, false, true>,
        dequantize_group<false, true, true>,   dequantize_group<true, true, true>,
    };
    return table[format & 7];
}

#if defined(__AVX2__) && defined(__FMA__)
constexpr int kLanes = 8;

inline __m256i lane_mask(int count) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(count), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// A dequantised group in the 8 KB buffer: weight (input p, output o).
struct Buffered {
    static constexpr bool kPairs = false;
    const float* weights;
    __m256 at(int64_t p, int64_t o) const { return _mm256_loadu_ps(weights + p * kWidth + o); }
    void pair(int64_t, int64_t, __m256&, __m256&) const {}
};

// Rows x (8 Blocks) outputs from ``column`` over one group: sums from zero (first) or ``partial`` (row stride kWidth);
// after the last group bias added and the first ``valid`` outputs stored, else the sums back to ``partial``.
template <int Rows, int Blocks, typename Weights>
void pass(const float* const* inputs, const Weights& weights, int64_t column, float* partial, bool first, bool last,
          const float* bias, float* const* outputs, int64_t valid) {
    __m256 sums[Rows][Blocks];
    for (int r = 0; r < Rows; ++r)
        for (int b = 0; b < Blocks; ++b)
            sums[r][b] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(partial + r * kWidth + b * kLanes);
    if constexpr (Weights::kPairs && Blocks == 8) {  // the whole tile: blocks b and b + 4 from the same bytes
        for (int64_t p = 0; p < kGroup; ++p)
            for (int b = 0; b < Blocks / 2; ++b) {
                __m256 first_half, second_half;
                weights.pair(p, b * kLanes, first_half, second_half);
                for (int r = 0; r < Rows; ++r) {
                    const __m256 input = _mm256_broadcast_ss(inputs[r] + p);
                    sums[r][b] = _mm256_fmadd_ps(first_half, input, sums[r][b]);
                    sums[r][b + Blocks / 2] = _mm256_fmadd_ps(second_half, input, sums[r][b + Blocks / 2]);
                }
            }
    } else {
        for (int64_t p = 0; p < kGroup; ++p)
            for (int b = 0; b < Blocks; ++b) {
                const __m256 w = weights.at(p, column + b * kLanes);
                for (int r = 0; r < Rows; ++r)
                    sums[r][b] = _mm256_fmadd_ps(w, _mm256_broadcast_ss(inputs[r] + p), sums[r][b]);
            }
    }
    if (!last) {
        for (int r = 0; r < Rows; ++r)
            for (int b = 0; b < Blocks; ++b) _mm256_storeu_ps(partial + r * kWidth + b * kLanes, sums[r][b]);
        return;
    }
    for (int b = 0; b < Blocks; ++b) {
        const int64_t left = valid - b * kLanes;
        if (left <= 0) break;
        const __m256i mask = lane_mask(static_cast<int>(std::min<int64_t>(kLanes, left)));
        const __m256 added = bias != nullptr ? _mm256_maskload_ps(bias + b * kLanes, mask) : _mm256_setzero_ps();
        for (int r = 0; r < Rows; ++r)
            _mm256_maskstore_ps(outputs[r] + b * kLanes, mask,
                                bias != nullptr ? _mm256_add_ps(sums[r][b], added) : sums[r][b]);
    }
}

// Up to four rows over one group, in passes over the tile's eight blocks of eight outputs (one row: all eight at once,
// eight independent sums; two rows four; three or four rows two).
template <int Rows, typename Weights>
void group_rows(const float* const* inputs, const Weights& weights, float* partial, bool first, bool last,
                const float* bias, float* const* outputs, int64_t valid) {
    constexpr int kBlocks = Rows == 1 ? 8 : Rows == 2 ? 4 : 2;
    float* shifted[Rows];
    for (int64_t column = 0; column < valid; column += kBlocks * kLanes) {
        for (int r = 0; r < Rows; ++r) shifted[r] = outputs[r] + column;
        pass<Rows, kBlocks>(inputs, weights, column, partial + column, first, last,
                            bias == nullptr ? nullptr : bias + column, shifted, valid - column);
    }
}

template <typename Weights>
void rows_with(int rows, const float* const* inputs, const Weights& weights, float* partial, bool first, bool last,
               const float* bias, float* const* outputs, int64_t valid) {
    switch (rows) {
        case 1: group_rows<1>(inputs, weights, partial, first, last, bias, outputs, valid); break;
        case 2: group_rows<2>(inputs, weights, partial, first, last, bias, outputs, valid); break;
        case 3: group_rows<3>(inputs, weights, partial, first, last, bias, outputs, valid); break;
        default: group_rows<4>(inputs, weights, partial, first, last, bias, outputs, valid); break;
    }
}

void rows_over_group(int rows, const float* const* inputs, const float* weights, float* partial, bool first, bool last,
                     const float* bias, float* const* outputs, int64_t valid) {
    rows_with(rows, inputs, Buffered{weights}, partial, first, last, bias, outputs, valid);
}

// At most kRowsPerGroup rows over one group read straight from its packed bytes (no buffer): the same weights, the
// same sums in the same order as rows_over_group over the dequantised group, so the same bits.
template <bool Nibbles, bool Offsets, bool Halves>
void rows_over_packed_group(int rows, const float* const* inputs, const uint8_t* source, int centre, float* partial,
                            bool first, bool last, const float* bias, float* const* outputs, int64_t valid) {
    rows_with(rows, inputs, InRegisters<Nibbles, Offsets, Halves>(source, centre), partial, first, last, bias, outputs,
              valid);
}

using PackedRows = void (*)(int, const float* const*, const uint8_t*, int, float*, bool, bool, const float*,
                            float* const*, int64_t);

PackedRows packed_rows(int64_t format) {
    static const PackedRows table[8] = {
        rows_over_packed_group<false, false, false>, rows_over_packed_group<true, false, false>,
        rows_over_packed_group<false, true, false>,  rows_over_packed_group<true, true, false>,
        rows_over_packed_group<false, false, true>,  rows_over_packed_group<true, false, true>,
        rows_over_packed_group<false, true, true>,   rows_over_packed_group<true, true, true>,
    };
    return table[format & 7];
}
constexpr bool kReadsPackedGroups = true;
#else
// The same sums one fused multiply-add at a time (std::fma rounds once, as the vector instruction does).
void rows_over_group(int rows, const float* const* inputs, const float* weights, float* partial, bool first, bool last,
                     const float* bias, float* const* outputs, int64_t valid) {
    for (int r = 0; r < rows; ++r)
        for (int64_t o = 0; o < valid; ++o) {
            float sum = first ? 0.0f : partial[r * kWidth + o];
            for (int64_t p = 0; p < kGroup; ++p) sum = std::fma(weights[p * kWidth + o], inputs[r][p], sum);
            if (last)
                outputs[r][o] = bias != nullptr ? sum + bias[o] : sum;
            else
                partial[r * kWidth + o] = sum;
        }
}

using PackedRows = void (*)(int, const float* const*, const uint8_t*, int, float*, bool, bool, const float*,
                            float* const*, int64_t);
inline PackedRows packed_rows(int64_t) { return nullptr; }
constexpr bool kReadsPackedGroups = false;
#endif

}  // namespace quantized_products

at::Tensor quantized_linear(const at::Tensor& inputs, const at::Tensor& packed, int64_t format,
                            const c10::optional<at::Tensor>& bias, int64_t out_features) {
    namespace qp = quantized_products;
    TORCH_CHECK(qp::valid_format(format), "format: the packing's format bits (0-15, centred only with nibbles)");
    TORCH_CHECK(inputs.dim() == 2 && inputs.scalar_type() == at::kFloat && inputs.stride(1) == 1,
                "inputs: (rows, in) float32, rows contiguous");
    TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                    packed.size(2) == qp::group_bytes(format),
                "packed: (tiles, groups, bytes) uint8 from the packing of this format");
    const int64_t rows = inputs.size(0), tiles = packed.size(0), groups = packed.size(1);
    TORCH_CHECK(inputs.size(1) == groups * qp::kGroup, "inputs: ", groups * qp::kGroup, " features");
    TORCH_CHECK(out_features > (tiles - 1) * qp::kWidth && out_features <= tiles * qp::kWidth, "out_features: the packing's");
    const bool biased = bias.has_value() && bias->defined();
    if (biased)
        TORCH_CHECK(bias->dim() == 1 && bias->size(0) == out_features && bias->is_contiguous() &&
                        bias->scalar_type() == at::kFloat,
                    "bias: (out,) float32");
    auto output = at::empty({rows, out_features}, inputs.options());
    if (rows == 0 || groups == 0) return output.zero_();
    const float* x = inputs.data_ptr<float>();
    const int64_t x_stride = inputs.stride(0);
    const uint8_t* weights = packed.data_ptr<uint8_t>();
    const float* offsets = biased ? bias->data_ptr<float>() : nullptr;
    float* y = output.data_ptr<float>();
    const int64_t bytes = qp::group_bytes(format);
    const qp::Dequantizer dequantize = qp::dequantizer(format);
    const int centre = format & qp::kCentred ? 8 : 0;
    const qp::PackedRows read_packed = qp::packed_rows(format);
    const bool direct = qp::kReadsPackedGroups && rows <= qp::kRowsPerGroup;
    at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
        std::vector<float> dequantized(qp::kGroup * qp::kWidth);
        std::vector<float> partial(rows * qp::kWidth);
        const float* row_inputs[qp::kRowsPerGroup];
        float* row_outputs[qp::kRowsPerGroup];
        for (int64_t t = begin; t < end; ++t) {
            const int64_t column = t * qp::kWidth;
            const int64_t valid = std::min<int64_t>(qp::kWidth, out_features - column);
            for (int64_t g = 0; g < groups; ++g) {
                const uint8_t* group = weights + (t * groups + g) * bytes;
                const bool first = g == 0, last = g == groups - 1;
                if (direct) {  // a few rows: each weight is used once, computed in registers
                    for (int r = 0; r < rows; ++r) {
                        row_inputs[r] = x + r * x_stride + g * qp::kGroup;
                        row_outputs[r] = y + r * out_features + column;
                    }
                    read_packed(static_cast<int>(rows), row_inputs, group, centre, partial.data(), first, last,
                                offsets == nullptr ? nullptr : offsets + column, row_outputs, valid);
                    continue;
                }
                dequantize(group, centre, dequantized.data());
                for (int64_t row = 0; row < rows; row += qp::kRowsPerGroup) {
                    const int count = static_cast<int>(std::min<int64_t>(qp::kRowsPerGroup, rows - row));
                    for (int r = 0; r < count; ++r) {
                        row_inputs[r] = x + (row + r) * x_stride + g * qp::kGroup;
                        row_outputs[r] = y + (row + r) * out_features + column;
                    }
                    qp::rows_over_group(count, row_inputs, dequantized.data(), partial.data() + row * qp::kWidth, first, last,
                                    offsets == nullptr ? nullptr : offsets + column, row_outputs, valid);
                }
            }
        }
    });
    return output;
}
