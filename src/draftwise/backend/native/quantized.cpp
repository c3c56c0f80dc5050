// Linear products (y = x W^T + b, float32 rows) over weights kept in GGUF's block quantisations, as integer dot
// products: the weights in the common form draftwise.backend.weights.quantized decodes every type to (per 32 inputs a
// scale, or two for inputs 0-15 and 16-31, an optional offset, small integer quants), and each row's activations
// quantised per group of 32 inputs to 8 bits (as llama.cpp's dot products take them) or, at twice the multiplies,
// to 16-bit fixed point in two int8 parts (the second keeps a forward within a hair of the float one):
//
//   d = max |x| / 127, q = round-to-nearest-even(x * (1 / d)) clamped to [-127, 127] (d = 0: every q = 0), then
//   with 16 bits the residual's r = round-to-nearest-even((x - d * q) * (256 / d)) clamped likewise (with 8 bits
//   r = 0); the activation is a = 256 q + r in units of d / 256;
//   per group and output, the integer sums over inputs 0-15 and 16-31 of quant * a (exact), then in float32
//   value = scale * sum (halves: scale_lo * sum_lo + scale_hi * sum_hi), value = value * (d / 256),
//   with offsets value = value + offset * ((d / 256) * sum of a), and the output's sum += value, group after group;
//   the bias last.
//
// Every operation is one float32 rounding in one fixed order per row, whatever the other rows of the call, the
// thread count or the vector width: a row of a verification forward is bitwise its one-row product. The integer sums
// are exact whichever way they are taken (byte products summed in int16 as far as int16 holds them, then widened; for
// signed quants over many rows of 16-bit activations, quants widened to int16 once per tile, see WideTile): the same
// integers, so the same bits.
//
// Packed layout, once at load: (tiles, groups, bytes) for tiles of 8 outputs and groups of 32 inputs: the 8 outputs'
// scales as float32 (a second row of 8 for inputs 16-31 with kHalves), their offsets (with kOffsets), then the quants
// in eight vectors of 32 bytes, vector k holding inputs 4k..4k+3 of output j at bytes 4j..4j+3 (a dot product over
// four inputs per 32-bit lane, one lane per output). Quants are stored unsigned as quant + centre (the centre is
// subtracted from the integer sums, exactly), in nibbles with kNibbles (vector k's low nibbles, vector k + 4's high
// ones), in six bits with kSixBits (those nibbles, then two vectors of the top two bits: quad k's at bits 2 (k % 4) of
// vector k / 4; Q6_K's and the 5-bit types' range), or as signed bytes with kSigned (Q8_0's range). With kFactored (k-quants) the units are super-blocks of 8
// groups: the 8 outputs' float32 scales (and offsets), then the 8 groups, each with int8 small scales (and small
// offsets) in place of the floats; a group's scale is super scale * small scale, exact in float32 (the same value
// as unfactored), so the arithmetic above does not change. With kHalfFloats a group's scales and offsets are stored
// as float16, where every one of them is a float16 value (the 32-input types' are: their files hold them so).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>
#include <c10/util/Optional.h>
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "kernels.h"

// (a namespace of its own: the vector sources are also compiled as one unit, beside linear.cpp's helpers)
namespace quantized_products {

constexpr int64_t kTile = 8;    // outputs per tile
constexpr int64_t kGroup = 32;  // inputs per quantisation block
constexpr int64_t kHalf = kGroup / 2;
constexpr int kRowsPerPass = 8;
constexpr int kWideRowsPerPass = 2;
constexpr int64_t kParallelValues = 32768;  // activations worth quantising on several threads

// Calls ``pass(first, rows_of_pass)`` over ``rows`` rows: kRowsPerPass at a time, then four, then the rest, or
// with OneLastPass the rest in one pass (``rows_of_pass`` a std::integral_constant, so each pass's kernel is compiled
// for its row count). (One last pass reads the weights once more instead of twice; the 512-bit kernels take it, which
// have the registers for any row count of a pass.)
template <bool OneLastPass = false, typename Pass>
inline void in_passes(int64_t rows, Pass&& pass) {
    int64_t first = 0;
    for (; first + kRowsPerPass <= rows; first += kRowsPerPass) pass(first, std::integral_constant<int, kRowsPerPass>{});
    if constexpr (OneLastPass) {
        switch (rows - first) {
            case 1: pass(first, std::integral_constant<int, 1>{}); break;
            case 2: pass(first, std::integral_constant<int, 2>{}); break;
            case 3: pass(first, std::integral_constant<int, 3>{}); break;
            case 4: pass(first, std::integral_constant<int, 4>{}); break;
            case 5: pass(first, std::integral_constant<int, 5>{}); break;
            case 6: pass(first, std::integral_constant<int, 6>{}); break;
            case 7: pass(first, std::integral_constant<int, 7>{}); break;
            default: break;
        }
        return;
    }
    if (first + 4 <= rows) {
        pass(first, std::integral_constant<int, 4>{});
        first += 4;
    }
    switch (rows - first) {
        case 1: pass(first, std::integral_constant<int, 1>{}); break;
        case 2: pass(first, std::integral_constant<int, 2>{}); break;
        case 3: pass(first, std::integral_constant<int, 3>{}); break;
        default: break;
    }
}

// The inner loops' helpers, inlined whatever the compiler's size budget: one left out of line (it happened to
// unpack_quants once the row loops grew) costs a call, a vzeroupper and the weights through memory on every group.
#define DRAFTWISE_HOT inline __attribute__((always_inline))

enum Format : int64_t {
    kNibbles = 1, kOffsets = 2, kHalves = 4, kSigned = 8, kFactored = 16, kHalfFloats = 32, kSixBits = 64
};
constexpr int kCentreShift = 7;  // format >> 7: the centre of unsigned quants
// How a group's scales are stored: float32, float16, or factored per super-block.
enum ScaleKind : int { kFloatScales = 0, kHalfScales = 1, kFactoredScales = 2 };
constexpr int64_t kSuperGroups = 8;  // groups in a factored super-block
// Groups sharing one activation scale in the super-block products (a divisor of kSuperGroups, even).
constexpr int64_t kScaleGroups = 4;

// (The format helpers run for every group of the inner loops: forced inline, since an inline function of a shared
// library that the compiler leaves out of line is called through its PLT.)
DRAFTWISE_HOT constexpr int centre_of(int64_t format) { return static_cast<int>(format >> kCentreShift); }

constexpr bool valid_format(int64_t format) {
    if (format < 0 || centre_of(format) > 127) return false;
    if ((format & kFactored) && (format & kHalfFloats)) return false;
    if ((format & kNibbles) && (format & kSixBits)) return false;
    if (format & kSigned) return (format & (kNibbles | kSixBits)) == 0 && centre_of(format) == 0;
    if (format & kSixBits) return centre_of(format) <= 63;
    return (format & kNibbles) == 0 || centre_of(format) <= 15;
}

// Bytes of one scale (or offset) of a group: float32, float16, or an int8 when factored.
DRAFTWISE_HOT constexpr int64_t scale_width(int64_t format) { return format & kFactored ? 1 : format & kHalfFloats ? 2 : 4; }

// Bytes of a group's scales (and offsets).
DRAFTWISE_HOT constexpr int64_t small_bytes(int64_t format) {
    const int64_t count = (format & kHalves ? 2 : 1) + (format & kOffsets ? 1 : 0);
    return count * kTile * scale_width(format);
}

DRAFTWISE_HOT constexpr int64_t group_bytes(int64_t format) {
    return small_bytes(format) + (format & kNibbles ? kGroup * kTile / 2 : format & kSixBits ? kGroup * kTile * 3 / 4
                                                                                             : kGroup * kTile);
}

// A factored super-block's header: the float32 super scales (and super offsets) of its tile's 8 outputs.
DRAFTWISE_HOT constexpr int64_t header_bytes(int64_t format) {
    return format & kFactored ? (format & kOffsets ? 2 : 1) * kTile * static_cast<int64_t>(sizeof(float)) : 0;
}

// Bytes of a packed unit: a group, or a factored super-block.
DRAFTWISE_HOT constexpr int64_t unit_bytes(int64_t format) {
    return format & kFactored ? header_bytes(format) + kSuperGroups * group_bytes(format) : group_bytes(format);
}

// Each row's activations quantised per group (see the notes above), stored group by group (a group's rows side by
// side, so a pass over several rows reads one run of memory per group), with a row of zeros after the last: a pass
// that pairs an odd row with the row after it (paired_rows) reads a row past a group's, whose products it drops.
struct QuantizedRows {
    int64_t rows, groups;
    std::vector<int8_t> quants;        // (groups, rows, 32): q
    std::vector<int8_t> residuals;     // (groups, rows, 32): r
    std::vector<float> scales;         // (groups, rows): d / 256
    std::vector<float> scaled_sums;    // (groups, rows): (d / 256) * sum of a
    std::vector<int32_t> centre_halves;  // (groups, rows, 2): centre * sum of a over inputs 0-15 and 16-31
    std::vector<int32_t> centre_sums;    // (groups, rows): centre * sum of a
    std::vector<int16_t> wide;         // (groups, rows, 32): a = 256 q + r, when asked for (else empty)
    bool with_residuals;               // 16-bit activations (else every r is 0)
    // Super-block activations (see the super-block products below): one d per kScaleGroups groups, kept in
    // ``scales`` for each of its groups (d itself, not d / 256), and the sums of q over each half group as int16 pairs.
    bool super_blocks;
    std::vector<int32_t> half_pairs;   // (groups, rows): sum of q over inputs 0-15 | (over 16-31) << 16
    std::vector<int32_t> group_pairs;  // (groups / 2, rows): sum of q over group 2p | (over group 2p + 1) << 16

    QuantizedRows(const float* x, int64_t x_stride, int64_t rows_, int64_t groups_, bool residuals_, int centre,
                  bool with_wide = false, bool super_blocks_ = false)
        : rows(rows_), groups(groups_), quants((rows_ * groups_ + 1) * kGroup),
          residuals((rows_ * groups_ + 1) * kGroup), scales(rows_ * groups_ + 1), scaled_sums(rows_ * groups_ + 1),
          centre_halves((rows_ * groups_ + 1) * 2), centre_sums(rows_ * groups_ + 1),
          wide(with_wide ? rows_ * groups_ * kGroup : 0), with_residuals(residuals_), super_blocks(super_blocks_),
          half_pairs(super_blocks_ ? rows_ * groups_ : 0), group_pairs(super_blocks_ ? rows_ * (groups_ / 2) : 0) {
        // Rows apart on the threads once there are enough of them (a prompt's), each row's steps the same.
        const int64_t grain = std::max<int64_t>(1, kParallelValues / std::max<int64_t>(1, groups * kGroup));
        at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
            for (int64_t r = begin; r < end; ++r) {
                if (super_blocks) quantize_super_row(x + r * x_stride, r);
                else quantize_row(x + r * x_stride, r, centre);
            }
        });
    }

    // Row r's blocks of kScaleGroups groups: d = max |x| / 127 over the block, each input's q as in quantize_group
    // (residuals zero), and the half groups' sums of q.
    void quantize_super_row(const float* row, int64_t r) {
        for (int64_t first = 0; first < groups; first += kScaleGroups) {
            const float* values = row + first * kGroup;
            const float d = largest_magnitude(values, kScaleGroups * kGroup) / 127.0f;
            const float inverse = d != 0.0f ? 1.0f / d : 0.0f;
            int32_t group_sums[kScaleGroups];
            for (int64_t k = 0; k < kScaleGroups; ++k) {
                const int64_t here = at(r, first + k);
                int32_t sums[2];
                quantize_with(values + k * kGroup, inverse, quants.data() + here * kGroup, sums);
                scales[here] = d;
                half_pairs[here] = (sums[0] & 0xFFFF) | static_cast<int32_t>(static_cast<uint32_t>(sums[1]) << 16);
                group_sums[k] = sums[0] + sums[1];
            }
            for (int64_t k = 0; k < kScaleGroups; k += 2)
                group_pairs[((first + k) / 2) * rows + r] =
                    (group_sums[k] & 0xFFFF) | static_cast<int32_t>(static_cast<uint32_t>(group_sums[k + 1]) << 16);
        }
    }

    // The largest |x| of ``count`` values (a multiple of 8), NaN skipped as std::max skips it here.
    static float largest_magnitude(const float* values, int64_t count) {
#if defined(__AVX2__)
        const __m256 magnitude_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
        __m256 largest8 = _mm256_setzero_ps();
        for (int64_t i = 0; i < count; i += 8)
            largest8 = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(values + i), magnitude_mask), largest8);
        __m128 largest4 = _mm_max_ps(_mm256_castps256_ps128(largest8), _mm256_extractf128_ps(largest8, 1));
        largest4 = _mm_max_ps(largest4, _mm_movehl_ps(largest4, largest4));
        largest4 = _mm_max_ss(largest4, _mm_shuffle_ps(largest4, largest4, 1));
        return _mm_cvtss_f32(largest4);
#else
        float largest = 0.0f;
        for (int64_t i = 0; i < count; ++i) largest = std::max(largest, std::fabs(values[i]));
        return largest;
#endif
    }

    // A group's 32 q = round-to-nearest-even(x * inverse) clamped to [-127, 127], and their sums over inputs 0-15
    // and 16-31.
    static void quantize_with(const float* values, float inverse, int8_t* q, int32_t* sums) {
#if defined(__AVX2__)
        const __m256 low = _mm256_set1_ps(-127.0f), high = _mm256_set1_ps(127.0f);
        __m256i q32[4];
        for (int k = 0; k < 4; ++k) {
            const __m256 scaled = _mm256_mul_ps(_mm256_loadu_ps(values + 8 * k), _mm256_set1_ps(inverse));
            const __m256 rounded = _mm256_round_ps(scaled, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            q32[k] = _mm256_cvttps_epi32(_mm256_min_ps(_mm256_max_ps(rounded, low), high));  // (NaN: max gives -127)
        }
        const __m256i words = _mm256_packs_epi16(_mm256_packs_epi32(q32[0], q32[1]), _mm256_packs_epi32(q32[2], q32[3]));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                            _mm256_permutevar8x32_epi32(words, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
        for (int h = 0; h < 2; ++h) {
            const __m256i both = _mm256_add_epi32(q32[2 * h], q32[2 * h + 1]);
            __m128i four = _mm_add_epi32(_mm256_castsi256_si128(both), _mm256_extracti128_si256(both, 1));
            four = _mm_add_epi32(four, _mm_shuffle_epi32(four, 0x4e));
            four = _mm_add_epi32(four, _mm_shuffle_epi32(four, 0xb1));
            sums[h] = _mm_cvtsi128_si32(four);
        }
#else
        sums[0] = sums[1] = 0;
        for (int64_t i = 0; i < kGroup; ++i) {
            q[i] = clamped(std::nearbyint(values[i] * inverse));
            sums[i / kHalf] += q[i];
        }
#endif
    }

    // Where row r's group g is kept (in units of a group's values).
    int64_t at(int64_t r, int64_t g) const { return g * rows + r; }

    // Row r's groups, from its values.
    void quantize_row(const float* row, int64_t r, int centre) {
        for (int64_t g = 0; g < groups; ++g) {
            const float* values = row + g * kGroup;
            const int64_t here = at(r, g);
            int32_t sums[2];
            const float d = quantize_group(values, quants.data() + here * kGroup, residuals.data() + here * kGroup,
                                           wide.empty() ? nullptr : wide.data() + here * kGroup, sums);
            scales[here] = d / 256.0f;
            scaled_sums[here] = scales[here] * static_cast<float>(sums[0] + sums[1]);
            centre_halves[2 * here] = centre * sums[0];
            centre_halves[2 * here + 1] = centre * sums[1];
            centre_sums[here] = centre * (sums[0] + sums[1]);
        }
    }

    // One group's 32 values: its q and r (and a = 256 q + r into ``wide`` unless null), the sums of a over inputs
    // 0-15 and 16-31 into ``sums``; returns d.
    float quantize_group(const float* values, int8_t* q, int8_t* residual, int16_t* wide_values,
                         int32_t* sums) const {
#if defined(__AVX2__)
        // Eight lanes at a time, each lane the scalar steps below: the same float32 operations (no contraction,
        // rounding to nearest even, the clamp's max and min taking the bound where the value is NaN, as std::max
        // and std::min do here), and a largest |x| that skips NaN as std::max does, in any order (a maximum of
        // values that are never negative zero nor NaN is the same in every order).
        const __m256 magnitude_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
        __m256 x[4], largest8 = _mm256_setzero_ps();
        for (int k = 0; k < 4; ++k) {
            x[k] = _mm256_loadu_ps(values + 8 * k);
            largest8 = _mm256_max_ps(_mm256_and_ps(x[k], magnitude_mask), largest8);  // (NaN lanes keep largest8)
        }
        __m128 largest4 = _mm_max_ps(_mm256_castps256_ps128(largest8), _mm256_extractf128_ps(largest8, 1));
        largest4 = _mm_max_ps(largest4, _mm_movehl_ps(largest4, largest4));
        largest4 = _mm_max_ss(largest4, _mm_shuffle_ps(largest4, largest4, 1));
        const float largest = _mm_cvtss_f32(largest4);
        const float d = largest / 127.0f;
        const float inverse = d != 0.0f ? 1.0f / d : 0.0f;
        const __m256 low = _mm256_set1_ps(-127.0f), high = _mm256_set1_ps(127.0f);
        const auto clamped_round = [&](__m256 value) {
            const __m256 rounded = _mm256_round_ps(value, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            return _mm256_min_ps(_mm256_max_ps(rounded, low), high);  // (NaN: max gives -127)
        };
        __m256i a[4];
        __m256i q32[4], r32[4];
        for (int k = 0; k < 4; ++k) {
            const __m256 quant = clamped_round(_mm256_mul_ps(x[k], _mm256_set1_ps(inverse)));
            q32[k] = _mm256_cvttps_epi32(quant);
            if (with_residuals) {
                const __m256 left = _mm256_sub_ps(x[k], _mm256_mul_ps(_mm256_set1_ps(d), quant));
                r32[k] = _mm256_cvttps_epi32(clamped_round(_mm256_mul_ps(left, _mm256_set1_ps(inverse * 256.0f))));
            } else {
                r32[k] = _mm256_setzero_si256();
            }
            a[k] = _mm256_add_epi32(_mm256_slli_epi32(q32[k], 8), r32[k]);
        }
        // int32 lanes to bytes in input order (the packs interleave 128-bit halves; the permute puts them back).
        const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
        const auto bytes_of = [&](const __m256i* lanes) {
            const __m256i words = _mm256_packs_epi16(_mm256_packs_epi32(lanes[0], lanes[1]),
                                                     _mm256_packs_epi32(lanes[2], lanes[3]));
            return _mm256_permutevar8x32_epi32(words, order);
        };
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), bytes_of(q32));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(residual), bytes_of(r32));
        if (wide_values != nullptr)
            for (int k = 0; k < 2; ++k)
                _mm256_storeu_si256(reinterpret_cast<__m256i*>(wide_values + 16 * k),
                                    _mm256_permute4x64_epi64(_mm256_packs_epi32(a[2 * k], a[2 * k + 1]), 0xd8));
        for (int h = 0; h < 2; ++h) {
            const __m256i both = _mm256_add_epi32(a[2 * h], a[2 * h + 1]);
            __m128i four = _mm_add_epi32(_mm256_castsi256_si128(both), _mm256_extracti128_si256(both, 1));
            four = _mm_add_epi32(four, _mm_shuffle_epi32(four, 0x4e));
            four = _mm_add_epi32(four, _mm_shuffle_epi32(four, 0xb1));
            sums[h] = _mm_cvtsi128_si32(four);
        }
        return d;
#else
        float largest = 0.0f;
        for (int64_t i = 0; i < kGroup; ++i) largest = std::max(largest, std::fabs(values[i]));
        const float d = largest / 127.0f;
        const float inverse = d != 0.0f ? 1.0f / d : 0.0f;
        sums[0] = sums[1] = 0;
        for (int64_t i = 0; i < kGroup; ++i) {
            q[i] = clamped(std::nearbyint(values[i] * inverse));
            residual[i] = with_residuals ? clamped(std::nearbyint((values[i] - d * static_cast<float>(q[i])) *
                                                                  (inverse * 256.0f)))
                                         : 0;
            sums[i / kHalf] += 256 * q[i] + residual[i];
            if (wide_values != nullptr) wide_values[i] = static_cast<int16_t>(256 * q[i] + residual[i]);
        }
        return d;
#endif
    }

    static int8_t clamped(float rounded) { return static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, rounded))); }
};

// A call's activations through plain pointers for the inner loops: read through QuantizedRows' vectors, their
// addresses would be reloaded for every row (the output stores might alias them, as far as the compiler knows).
struct RowData {
    const int8_t* quants;
    const int8_t* residuals;
    const float* scales;
    const float* scaled_sums;
    const int32_t* centre_halves;
    const int32_t* centre_sums;

    explicit RowData(const QuantizedRows& a)
        : quants(a.quants.data()), residuals(a.residuals.data()), scales(a.scales.data()),
          scaled_sums(a.scaled_sums.data()), centre_halves(a.centre_halves.data()), centre_sums(a.centre_sums.data()) {}
};

// Where group g of a tile starts (its scales, then its quants).
DRAFTWISE_HOT const uint8_t* group_start(const uint8_t* tile, int64_t g, int64_t format) {
    if (!(format & kFactored)) return tile + g * group_bytes(format);
    return tile + (g / kSuperGroups) * unit_bytes(format) + header_bytes(format) + (g % kSuperGroups) * group_bytes(format);
}

// Where group g's super-block header starts (factored formats).
DRAFTWISE_HOT const float* super_floats(const uint8_t* tile, int64_t g, int64_t format) {
    return reinterpret_cast<const float*>(tile + (g / kSuperGroups) * unit_bytes(format));
}

DRAFTWISE_HOT const uint8_t* group_quants(const uint8_t* source, int64_t format) { return source + small_bytes(format); }

// Output j's scale (part 0), second-half scale (part 1, with kHalves) and offset (part 2, with kOffsets) in group g:
// the float32 of an unfactored group, or super value * small integer (exact) of a factored one.
inline float group_float(const uint8_t* tile, int64_t g, int64_t format, int part, int64_t j) {
    const uint8_t* source = group_start(tile, g, format);
    const int slot = part == 2 ? (format & kHalves ? 2 : 1) : part;
    if (format & kHalfFloats) {
        const uint16_t bits = reinterpret_cast<const uint16_t*>(source)[slot * kTile + j];
        return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
    }
    if (!(format & kFactored)) return reinterpret_cast<const float*>(source)[slot * kTile + j];
    const float* header = super_floats(tile, g, format);
    const float super = header[(part == 2 ? 1 : 0) * kTile + j];
    return super * static_cast<float>(reinterpret_cast<const int8_t*>(source)[slot * kTile + j]);
}

#if defined(__AVX2__)
// add_dot: each 32-bit lane of ``sums`` plus the dot product of its four unsigned and four signed bytes, exact (one
// instruction with VNNI; else maddubs, whose pairs of products here stay below int16's limit, and madd).
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
constexpr bool kDotInstruction = true;
DRAFTWISE_HOT __m256i add_dot(__m256i sums, __m256i unsigned_bytes, __m256i signed_bytes) {
    return _mm256_dpbusd_epi32(sums, unsigned_bytes, signed_bytes);
}
#elif defined(__AVXVNNI__)
constexpr bool kDotInstruction = true;
DRAFTWISE_HOT __m256i add_dot(__m256i sums, __m256i unsigned_bytes, __m256i signed_bytes) {
    return _mm256_dpbusd_avx_epi32(sums, unsigned_bytes, signed_bytes);
}
#else
constexpr bool kDotInstruction = false;
DRAFTWISE_HOT __m256i add_dot(__m256i sums, __m256i unsigned_bytes, __m256i signed_bytes) {
    return _mm256_add_epi32(
        sums, _mm256_madd_epi16(_mm256_maddubs_epi16(unsigned_bytes, signed_bytes), _mm256_set1_epi16(1)));
}
#endif

// Inputs 4k..4k+3 of a row's 32 int8 activations in every 32-bit lane.
DRAFTWISE_HOT __m256i broadcast_quad(const int8_t* values, int k) {
    int32_t quad;
    std::memcpy(&quad, values + 4 * k, sizeof(quad));
    return _mm256_set1_epi32(quad);
}

inline __m256i lane_mask(int64_t count) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(count)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// Eight int8 at ``small`` times the eight floats of ``super``, in float32 (exact for a factored layout's values).
DRAFTWISE_HOT __m256 small_times(const uint8_t* small, __m256 super) {
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(small));
    return _mm256_mul_ps(super, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)));
}

// Eight float16 at ``source`` in float32 (exact).
DRAFTWISE_HOT __m256 eight_halves(const uint8_t* source) {
#if defined(__F16C__)
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(source)));
#else
    alignas(32) float values[8];
    for (int j = 0; j < 8; ++j)
        values[j] = static_cast<float>(c10::Half(reinterpret_cast<const uint16_t*>(source)[j], c10::Half::from_bits()));
    return _mm256_load_ps(values);
#endif
}

// How far ahead of the quants being read a product asks for the weights: a row's product streams the weights from
// memory with little arithmetic per byte, and the hardware prefetcher alone left a two-core Zen 3 at ~12 GB/s of its
// ~19 (Qwen2.5-1.5B Q4_K_M one-row steps 83 -> 64-68 ms with 2 KiB; 0.5-1.5 KiB 68-75 ms, 4 KiB 84 ms).
constexpr int64_t kPrefetchBytes = 2048;
// A second request, far ahead and to the second-level cache only: a product of several rows spends long enough on
// each byte that the first level's few outstanding misses did not keep memory busy, and reading and arithmetic came one
// after the other (Zen 5, Qwen2.5-1.5B Q4_K_M forwards of 8 rows with 8-bit activations 49 -> 40 ms, 16 rows 88 -> 74
// ms, one row unchanged at 25 ms; 8 KiB ahead 44 ms, 32 KiB as 16).
constexpr int64_t kFarPrefetchBytes = 16384;
constexpr int64_t kCacheLine = 64;

// The cache lines ``bytes`` long at kPrefetchBytes (to the first-level cache) and kFarPrefetchBytes (to the second)
// past ``packed``, asked for.
DRAFTWISE_HOT void prefetch_ahead(const uint8_t* packed, int64_t bytes) {
    for (int64_t line = 0; line < bytes; line += kCacheLine)
        _mm_prefetch(reinterpret_cast<const char*>(packed + kPrefetchBytes + line), _MM_HINT_T0);
    for (int64_t line = 0; line < bytes; line += kCacheLine)
        _mm_prefetch(reinterpret_cast<const char*>(packed + kFarPrefetchBytes + line), _MM_HINT_T1);
}

// Reads a tile's groups one after the other: each group's float32 factors of the tile's 8 outputs (scale, the
// second half's scale with kHalves, offset with kOffsets; zero where absent) and where its quants start.
template <bool Offsets, bool Halves, int Scales>
struct GroupReader {
    static constexpr bool kFactoredLayout = Scales == kFactoredScales;
    static constexpr int64_t kScaleWidth = kFactoredLayout ? 1 : Scales == kHalfScales ? 2 : sizeof(float);
    const uint8_t* source;
    int64_t format, bytes;
    __m256 super_scale = _mm256_setzero_ps(), super_offset = _mm256_setzero_ps();
    __m256 scale = _mm256_setzero_ps(), scale_high = _mm256_setzero_ps(), offset = _mm256_setzero_ps();

    GroupReader(const uint8_t* tile, int64_t format_) : source(tile), format(format_), bytes(group_bytes(format_)) {}

    // Group g's factors (groups are read in order); returns its packed quants.
    DRAFTWISE_HOT const uint8_t* next(int64_t g) {
        if (kFactoredLayout) {
            if (g % kSuperGroups == 0) {  // a super-block's header, then its groups
                const float* header = reinterpret_cast<const float*>(source);
                super_scale = _mm256_loadu_ps(header);
                if (Offsets) super_offset = _mm256_loadu_ps(header + kTile);
                source += header_bytes(format);
            }
            scale = small_times(source, super_scale);
            if (Halves) scale_high = small_times(source + kTile * kScaleWidth, super_scale);
            if (Offsets) offset = small_times(source + (Halves ? 2 : 1) * kTile * kScaleWidth, super_offset);
        } else if (Scales == kHalfScales) {
            scale = eight_halves(source);
            if (Halves) scale_high = eight_halves(source + kTile * kScaleWidth);
            if (Offsets) offset = eight_halves(source + (Halves ? 2 : 1) * kTile * kScaleWidth);
        } else {
            const float* floats = reinterpret_cast<const float*>(source);
            scale = _mm256_loadu_ps(floats);
            if (Halves) scale_high = _mm256_loadu_ps(floats + kTile);
            if (Offsets) offset = _mm256_loadu_ps(floats + (Halves ? 2 : 1) * kTile);
        }
        const uint8_t* packed = group_quants(source, format);
        source += bytes;
        return packed;
    }
};

// A group's quants as eight vectors of bytes, vector k holding inputs 4k..4k+3 of output j at bytes 4j..4j+3
// (unsigned, centre included; signed bytes for kSigned).
template <bool Nibbles, bool SixBits>
DRAFTWISE_HOT void unpack_quants(const uint8_t* packed, __m256i* weights) {
    if (Nibbles || SixBits) {
        const __m256i low_nibbles = _mm256_set1_epi8(15);
        for (int k = 0; k < 4; ++k) {
            const __m256i both = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(packed + 32 * k));
            weights[k] = _mm256_and_si256(both, low_nibbles);
            weights[k + 4] = _mm256_and_si256(_mm256_srli_epi16(both, 4), low_nibbles);
        }
        if (SixBits) {  // each quad's top two bits, moved to bits 4-5 of its bytes
            const __m256i top_bits = _mm256_set1_epi8(0x30);
            for (int m = 0; m < 2; ++m) {
                const __m256i plane = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(packed + 128 + 32 * m));
                weights[4 * m] = _mm256_or_si256(weights[4 * m], _mm256_and_si256(_mm256_slli_epi16(plane, 4), top_bits));
                weights[4 * m + 1] = _mm256_or_si256(weights[4 * m + 1], _mm256_and_si256(_mm256_slli_epi16(plane, 2), top_bits));
                weights[4 * m + 2] = _mm256_or_si256(weights[4 * m + 2], _mm256_and_si256(plane, top_bits));
                weights[4 * m + 3] = _mm256_or_si256(weights[4 * m + 3], _mm256_and_si256(_mm256_srli_epi16(plane, 2), top_bits));
            }
        }
    } else {
        for (int k = 0; k < 8; ++k) weights[k] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(packed + 32 * k));
    }
}

// A group's value for one row from its integer sums over inputs 0-15 and 16-31 (without kHalves, any two integers
// whose sum is the group's: they are added first) by the notes' float32 steps (``unit``: the row's d / 256 there,
// ``scaled_sum``: (d / 256) * sum of a), added to the row's sum.
template <bool Offsets, bool Halves, int Scales>
DRAFTWISE_HOT __m256 add_group_value(__m256 sum, const GroupReader<Offsets, Halves, Scales>& group, __m256i low_half,
                                     __m256i high_half, float unit, float scaled_sum) {
    __m256 value;
    if (Halves)
        value = _mm256_add_ps(_mm256_mul_ps(group.scale, _mm256_cvtepi32_ps(low_half)),
                              _mm256_mul_ps(group.scale_high, _mm256_cvtepi32_ps(high_half)));
    else
        value = _mm256_mul_ps(group.scale, _mm256_cvtepi32_ps(_mm256_add_epi32(low_half, high_half)));
    value = _mm256_mul_ps(value, _mm256_set1_ps(unit));
    if (Offsets) value = _mm256_add_ps(value, _mm256_mul_ps(group.offset, _mm256_set1_ps(scaled_sum)));
    return _mm256_add_ps(sum, value);
}

// The rows' sums (plus the bias) into their outputs' first ``valid`` columns.
template <int Rows>
inline void store_rows(const __m256* sums, int64_t first, const float* bias, float* y, int64_t y_stride, int64_t valid) {
    const __m256i mask = lane_mask(valid);
    const __m256 added = bias != nullptr ? _mm256_maskload_ps(bias, mask) : _mm256_setzero_ps();
    for (int r = 0; r < Rows; ++r)
        _mm256_maskstore_ps(y + (first + r) * y_stride, mask, bias != nullptr ? _mm256_add_ps(sums[r], added) : sums[r]);
}

// How many byte-product pairs (maddubs lanes) int16 holds the sum of, by the quants' range: nibbles 2 * 15 * 127 =
// 3810 each (8 fit), six bits 2 * 63 * 127 = 16002 (2 fit), bytes 2 * 127 * 127 (1). Summing them before widening to
// int32 leaves the same integers with fewer multiply-adds.
template <bool Nibbles, bool SixBits>
constexpr int kPairSums = Nibbles ? 8 : SixBits ? 2 : 1;

// The int16 pair sums of quads [Begin, End) of a row's bytes at ``values`` times the weights, added as a tree (a
// short dependency chain; integer sums in any order are the same).
template <int Begin, int End>
DRAFTWISE_HOT __m256i pair_sums(const __m256i* weights, const int8_t* values) {
    static_assert(End > Begin, "a tree over at least one quad");
    if constexpr (End - Begin == 1) {
        return _mm256_maddubs_epi16(weights[Begin], broadcast_quad(values, Begin));
    } else {
        constexpr int middle = Begin + (End - Begin) / 2;
        return _mm256_add_epi16(pair_sums<Begin, middle>(weights, values), pair_sums<middle, End>(weights, values));
    }
}

// The integer sum of quads [Begin, End) of one row's bytes at ``values`` times a group's weights, per output (exact).
template <bool Nibbles, bool SixBits, bool Signed, int Begin, int End>
DRAFTWISE_HOT __m256i quad_sums(const __m256i* weights, const __m256i* magnitudes, const int8_t* values) {
    constexpr int per = kPairSums<Nibbles, SixBits>;
    if constexpr (!Signed && !kDotInstruction && per > 1) {
        constexpr int middle = Begin + per < End ? Begin + per : End;
        const __m256i sums = _mm256_madd_epi16(pair_sums<Begin, middle>(weights, values), _mm256_set1_epi16(1));
        if constexpr (middle == End) return sums;
        else return _mm256_add_epi32(sums, quad_sums<Nibbles, SixBits, Signed, middle, End>(weights, magnitudes, values));
    } else {
        __m256i sums = _mm256_setzero_si256();
        for (int k = Begin; k < End; ++k) {
            if (Signed)  // |w| times the activation with w's sign
                sums = add_dot(sums, magnitudes[k], _mm256_sign_epi8(broadcast_quad(values, k), weights[k]));
            else
                sums = add_dot(sums, weights[k], broadcast_quad(values, k));
        }
        return sums;
    }
}

// A group's fixed-point sums 256 * (quants' sum) + (residuals' sum) - centre term over quads [Begin, End) of a row
// (its bytes at ``quants`` and ``residuals``; ``centre_term``: the centre times its activations' sum there).
template <bool Nibbles, bool SixBits, bool Signed, bool Residuals, int Begin, int End>
DRAFTWISE_HOT __m256i fixed_sums(const __m256i* weights, const __m256i* magnitudes, const int8_t* quants,
                          const int8_t* residuals, int centre, const int32_t* centre_term) {
    __m256i total = _mm256_slli_epi32(quad_sums<Nibbles, SixBits, Signed, Begin, End>(weights, magnitudes, quants), 8);
    if (Residuals)
        total = _mm256_add_epi32(total, quad_sums<Nibbles, SixBits, Signed, Begin, End>(weights, magnitudes, residuals));
    if (!Signed && centre != 0) total = _mm256_sub_epi32(total, _mm256_set1_epi32(*centre_term));
    return total;
}

// The rows [first, first + Rows) over one tile: every group's integer sums from the unpacked weights, then its value.
// (Residuals: the rows' activations have residuals; without, their products are zero and skipped.)
template <bool Nibbles, bool SixBits, bool Signed, bool Offsets, bool Halves, int Scales, bool Residuals, int Rows>
void tile_rows(const uint8_t* tile, int64_t groups, int64_t format, const QuantizedRows& a,
               int64_t first, const float* bias, float* y, int64_t y_stride, int64_t valid) {
    const int centre = centre_of(format);
    const RowData data(a);
    __m256 sums[Rows];
    for (int r = 0; r < Rows; ++r) sums[r] = _mm256_setzero_ps();
    GroupReader<Offsets, Halves, Scales> group(tile, format);
    for (int64_t g = 0; g < groups; ++g) {
        const uint8_t* packed = group.next(g);
        // (a hint where few rows leave the product waiting on memory; at many rows it only costs issue slots)
        if (Rows < kRowsPerPass) prefetch_ahead(packed, group.bytes);
        __m256i weights[8];
        unpack_quants<Nibbles, SixBits>(packed, weights);
        __m256i magnitudes[8];
        if (Signed)
            for (int k = 0; k < 8; ++k) magnitudes[k] = _mm256_abs_epi8(weights[k]);
        const int64_t base = a.at(first, g);  // the pass's rows are side by side from here
#pragma GCC unroll 8
        for (int r = 0; r < Rows; ++r) {
            const int64_t at = base + r;
            const int8_t* q = data.quants + at * kGroup;
            const int8_t* residual = data.residuals + at * kGroup;
            if (Halves) {
                const __m256i low = fixed_sums<Nibbles, SixBits, Signed, Residuals, 0, 4>(
                    weights, magnitudes, q, residual, centre, data.centre_halves + 2 * at);
                const __m256i high = fixed_sums<Nibbles, SixBits, Signed, Residuals, 4, 8>(
                    weights, magnitudes, q, residual, centre, data.centre_halves + 2 * at + 1);
                sums[r] = add_group_value(sums[r], group, low, high, data.scales[at], data.scaled_sums[at]);
            } else {  // (one sum over both halves: add_group_value adds the halves' sums as integers anyway)
                const __m256i whole = fixed_sums<Nibbles, SixBits, Signed, Residuals, 0, 8>(
                    weights, magnitudes, q, residual, centre, data.centre_sums + at);
                sums[r] = add_group_value(sums[r], group, whole, _mm256_setzero_si256(), data.scales[at],
                                          data.scaled_sums[at]);
            }
        }
    }
    store_rows<Rows>(sums, first, bias, y, y_stride, valid);
}

// Many rows of 16-bit activations without a dot-product instruction, signed quants (Q8_0's range): the tile's quants
// widened once to int16, and each row's activations a = 256 q + r as int16, so one multiply-add (vpmaddwd) takes two
// inputs of four outputs for a row: half the multiplies of the two byte products per input of tile_rows and no sign
// fix-up. The integer sums are the same integers, the float32 steps the same: bitwise tile_rows. (Nibbles and six
// bits sum several byte products in int16 before widening, which beat widened products at every row count measured on
// a two-core Zen 3, 1.0-1.3x at 8-64 rows; 8-bit activations have half the byte products and never widen.)
struct WideTile {
    std::vector<__m256i> weights;  // (groups, 8 quads, outputs 0-3 | 4-7): int16, inputs 4k..4k+3 of each output
};

// Rows from which a call widens (Q8_0 there: 16-64 rows 1.25-1.3x the byte products, 8 rows 0.97x).
constexpr int64_t kWideFromRows = 16;

void widen_signed_tile(const uint8_t* tile, int64_t groups, int64_t format, WideTile& wide) {
    wide.weights.resize(groups * 16);
    for (int64_t g = 0; g < groups; ++g) {
        __m256i weights[8];
        unpack_quants<false, false>(group_quants(group_start(tile, g, format), format), weights);
        for (int k = 0; k < 8; ++k) {
            __m256i* out = wide.weights.data() + g * 16 + 2 * k;
            out[0] = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(weights[k]));
            out[1] = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(weights[k], 1));
        }
    }
}

// Eight int32 lanes of outputs 0-7 from the pairwise sums of outputs 0-3 (``low``) and 4-7 (``high``), two lanes each.
DRAFTWISE_HOT __m256i output_sums(__m256i low, __m256i high) {
    return _mm256_permute4x64_epi64(_mm256_hadd_epi32(low, high), _MM_SHUFFLE(3, 1, 2, 0));
}

template <bool Offsets, bool Halves, int Scales, int Rows>
void wide_rows(const uint8_t* tile, const WideTile& wide, int64_t groups, int64_t format, const QuantizedRows& a,
               int64_t first, const float* bias, float* y, int64_t y_stride, int64_t valid) {
    __m256 sums[Rows];
    for (int r = 0; r < Rows; ++r) sums[r] = _mm256_setzero_ps();
    GroupReader<Offsets, Halves, Scales> group(tile, format);
    for (int64_t g = 0; g < groups; ++g) {
        group.next(g);
        const __m256i* weights = wide.weights.data() + g * 16;
        for (int r = 0; r < Rows; ++r) {
            const int64_t at = a.at(first + r, g);
            const int16_t* values = a.wide.data() + at * kGroup;
            __m256i totals[2][2];  // (inputs 0-15 | 16-31, outputs 0-3 | 4-7)
            for (int h = 0; h < 2; ++h) totals[h][0] = totals[h][1] = _mm256_setzero_si256();
            for (int k = 0; k < 8; ++k) {
                int64_t quad;
                std::memcpy(&quad, values + 4 * k, sizeof(quad));
                const __m256i broadcast = _mm256_set1_epi64x(quad);
                totals[k / 4][0] = _mm256_add_epi32(totals[k / 4][0], _mm256_madd_epi16(weights[2 * k], broadcast));
                totals[k / 4][1] = _mm256_add_epi32(totals[k / 4][1], _mm256_madd_epi16(weights[2 * k + 1], broadcast));
            }
            sums[r] = add_group_value(sums[r], group, output_sums(totals[0][0], totals[0][1]),
                                      output_sums(totals[1][0], totals[1][1]), a.scales[at], a.scaled_sums[at]);
        }
    }
    store_rows<Rows>(sums, first, bias, y, y_stride, valid);
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define DRAFTWISE_VNNI512 1  // (the 512-bit kernels below: paired rows, quad pairs and tile pairs)
// Two rows in each 512-bit vector (a tile's 8 outputs for the first row in the low half, for the second in the high
// half), where a dot-product instruction takes them: a pass's rows take half the multiply-adds and half the float32
// steps of tile_rows. Each output's lane has the same integer sums and the same float32 operations in the same order
// as tile_rows's (the kernels build without contraction into fused multiply-adds): bitwise the same products. The
// weights are read as tile_rows reads them (one tile after the other: reading two tiles side by side slowed the
// products streaming from memory), a single row stays on tile_rows. Only for formats with two scales a group
// (Q6_K), whose float32 steps weigh most; measured on a two-core Zen 5, Qwen2.5-1.5B Q4_K_M forwards of 8-32 rows
// 1.10-1.15x faster so, while pairing every format made SmolLM2's Q4_1 forwards 0.86-0.95x (nibble formats' products
// 0.8-1.1x).
DRAFTWISE_HOT __m512 both_halves(__m256 value) {
    return _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(value)));
}

// ``first`` in lanes 0-7, ``second`` in lanes 8-15.
DRAFTWISE_HOT __m512 pair_of(float first, float second) {
    return _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(first), _mm512_set1_ps(second));
}

DRAFTWISE_HOT __m512i pair_of(int32_t first, int32_t second) {
    return _mm512_mask_blend_epi32(0xFF00, _mm512_set1_epi32(first), _mm512_set1_epi32(second));
}

// The integer sums of half ``Half`` of a group's quads (inputs 16 Half .. 16 Half + 15) of two rows (their 32 bytes
// each side by side at ``values``) times the group's weights (in both halves of each vector), per output (exact).
// Signed quants: ``weights`` their magnitudes, ``negative`` where they are below zero, and the activation's sign is
// turned there (activations lie in [-127, 127]: negating one is exact).
template <bool Signed, int Half>
DRAFTWISE_HOT __m512i paired_quad_sums(const __m512i* weights, const __mmask64* negative, const int8_t* values) {
    const __m512i pair_bytes = _mm512_loadu_si512(values);  // (row one's 32 bytes, then row two's)
    // 128-bit lanes: row one's quads 4 Half .. 4 Half + 3 twice, then row two's twice
    const __m512i lanes = Half == 0 ? _mm512_shuffle_i32x4(pair_bytes, pair_bytes, _MM_SHUFFLE(2, 2, 0, 0))
                                    : _mm512_shuffle_i32x4(pair_bytes, pair_bytes, _MM_SHUFFLE(3, 3, 1, 1));
    __m512i sums = _mm512_setzero_si512();
    for (int k = 4 * Half; k < 4 * Half + 4; ++k) {
        __m512i quads;
        switch (k % 4) {  // (the shuffle's control must be a constant)
            case 0: quads = _mm512_shuffle_epi32(lanes, static_cast<_MM_PERM_ENUM>(0x00)); break;
            case 1: quads = _mm512_shuffle_epi32(lanes, static_cast<_MM_PERM_ENUM>(0x55)); break;
            case 2: quads = _mm512_shuffle_epi32(lanes, static_cast<_MM_PERM_ENUM>(0xAA)); break;
            default: quads = _mm512_shuffle_epi32(lanes, static_cast<_MM_PERM_ENUM>(0xFF)); break;
        }
        if constexpr (Signed) quads = _mm512_mask_sub_epi8(quads, negative[k], _mm512_setzero_si512(), quads);
        sums = _mm512_dpbusd_epi32(sums, weights[k], quads);
    }
    return sums;
}

// fixed_sums of half ``Half`` of a group for two rows (``centre_terms``: the first row's centre terms of both halves,
// the second row's after them).
template <bool Signed, bool Residuals, int Half>
DRAFTWISE_HOT __m512i paired_fixed_sums(const __m512i* weights, const __mmask64* negative, const int8_t* quants,
                                        const int8_t* residuals, int centre, const int32_t* centre_terms) {
    // (named first: without optimisation the shift is a macro, whose arguments a template's comma would split)
    const __m512i quant_sums = paired_quad_sums<Signed, Half>(weights, negative, quants);
    __m512i total = _mm512_slli_epi32(quant_sums, 8);
    if (Residuals) total = _mm512_add_epi32(total, paired_quad_sums<Signed, Half>(weights, negative, residuals));
    if (!Signed && centre != 0) total = _mm512_sub_epi32(total, pair_of(centre_terms[Half], centre_terms[2 + Half]));
    return total;
}

// tile_rows for Pairs pairs of rows from ``first``, of which the first ``Stored`` are stored (2 Pairs - 1: the last
// pair's second row is whatever follows, its products dropped).
template <bool Nibbles, bool SixBits, bool Signed, bool Offsets, bool Halves, int Scales, bool Residuals, int Pairs,
          int Stored = 2 * Pairs>
void paired_tile_rows(const uint8_t* tile, int64_t groups, int64_t format, const QuantizedRows& a, int64_t first,
                      const float* bias, float* y, int64_t y_stride, int64_t valid) {
    static_assert(Halves, "pairs for formats with two scales a group only (see above)");
    const int centre = centre_of(format);
    const RowData data(a);
    __m512 sums[Pairs];
    for (int p = 0; p < Pairs; ++p) sums[p] = _mm512_setzero_ps();
    GroupReader<Offsets, Halves, Scales> group(tile, format);
    for (int64_t g = 0; g < groups; ++g) {
        const uint8_t* packed = group.next(g);
        // (on every pass, unlike tile_rows: with half the instructions a row, 8-row passes wait on memory too; Qwen
        // forwards of 8-16 rows measured 2-5 % faster so on a Zen 5)
        prefetch_ahead(packed, group.bytes);
        __m512i weights[8];
        __mmask64 negative[8] = {};  // (signed quants only)
        {
            __m256i unpacked[8];
            unpack_quants<Nibbles, SixBits>(packed, unpacked);
            for (int k = 0; k < 8; ++k) {
                weights[k] = _mm512_broadcast_i64x4(unpacked[k]);
                if constexpr (Signed) {
                    negative[k] = _mm512_movepi8_mask(weights[k]);
                    weights[k] = _mm512_abs_epi8(weights[k]);
                }
            }
        }
        const __m512 scale = both_halves(group.scale), scale_high = both_halves(group.scale_high);
        const __m512 offset = Offsets ? both_halves(group.offset) : _mm512_setzero_ps();
        const int64_t base = a.at(first, g);
#pragma GCC unroll 8
        for (int p = 0; p < Pairs; ++p) {
            const int64_t at = base + 2 * p;  // (the pair's second row at at + 1)
            const int8_t* q = data.quants + at * kGroup;
            const int8_t* residual = data.residuals + at * kGroup;
            // add_group_value's steps
            const __m512i low = paired_fixed_sums<Signed, Residuals, 0>(weights, negative, q, residual, centre,
                                                                        data.centre_halves + 2 * at);
            const __m512i high = paired_fixed_sums<Signed, Residuals, 1>(weights, negative, q, residual, centre,
                                                                         data.centre_halves + 2 * at);
            __m512 value = _mm512_add_ps(_mm512_mul_ps(scale, _mm512_cvtepi32_ps(low)),
                                         _mm512_mul_ps(scale_high, _mm512_cvtepi32_ps(high)));
            value = _mm512_mul_ps(value, pair_of(data.scales[at], data.scales[at + 1]));
            if (Offsets)
                value = _mm512_add_ps(value, _mm512_mul_ps(offset, pair_of(data.scaled_sums[at], data.scaled_sums[at + 1])));
            sums[p] = _mm512_add_ps(sums[p], value);
        }
    }
    __m256 row_sums[2 * Pairs];
    for (int p = 0; p < Pairs; ++p) {
        row_sums[2 * p] = _mm512_castps512_ps256(sums[p]);
        row_sums[2 * p + 1] = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(sums[p]), 1));
    }
    store_rows<Stored>(row_sums, first, bias, y, y_stride, valid);
}

// Every row of a call through paired_tile_rows: kRowsPerPass at a time, then the rest in one pass (an odd row paired
// with the row after it, dropped: two rows a vector cost about what one does, a second pass over the weights more;
// Q6_K 8960 x 1536 in cache on a Zen 5, 3 rows 275 us as a pair and a row alone, 4 rows 229), a call of one row alone.
template <bool Nibbles, bool SixBits, bool Signed, bool Offsets, bool Halves, int Scales, bool Residuals>
void paired_rows(const uint8_t* tile, int64_t groups, int64_t format, const QuantizedRows& a, int64_t rows,
                 const float* bias, float* y, int64_t y_stride, int64_t valid) {
    if (rows == 1) {
        tile_rows<Nibbles, SixBits, Signed, Offsets, Halves, Scales, Residuals, 1>(tile, groups, format, a, 0, bias, y,
                                                                                  y_stride, valid);
        return;
    }
    in_passes<true>(rows, [&](int64_t first, auto count) {
        constexpr int kRows = decltype(count)::value;
        paired_tile_rows<Nibbles, SixBits, Signed, Offsets, Halves, Scales, Residuals, (kRows + 1) / 2, kRows>(
            tile, groups, format, a, first, bias, y, y_stride, valid);
    });
}

// Quad pairs, for formats with one scale a group (Q4_0, Q4_1, Q4_K, Q5_*, Q8_0):
// each 512-bit vector holds two quads of a tile's 8 outputs (output j's quad k in lane 2j, quad k + 1 in lane
// 2j + 1), so that one 64-bit broadcast of a row's eight activations k..k+1 feeds one vpdpbusd for both: a row
// takes half the dot-product instructions and half the broadcasts of tile_rows. After a group's quads the lane
// pairs are added (output j's integer sum, exactly the integer tile_rows takes) and the float32 steps are
// tile_rows's own, on eight lanes: bitwise the same products. The weights are interleaved once per group and pass,
// for all the pass's rows. Measured on a two-core Zen 5, Q4_0 products of 8-16 rows with 16-bit activations
// 1.2-1.3x faster (1536 x 1536 and 8960 x 1536), 8-bit ones about the same: the float32 steps, eight outputs a
// vector, weigh as much as the dot products, which tile pairs (below, from six rows) halve. From two rows: Q4_K 8960
// x 1536 in cache, 2 / 3 rows 148 / 207 -> 130 / 177 us (8-bit), 199 / 276 -> 166 / 234 (16-bit); Qwen2.5-Coder-1.5B
// Q4_K_M forwards of 2 / 3 rows (16-bit) 30 / 43 -> 28 / 40 ms.
constexpr int64_t kQuadPairsFromRows = 2;

DRAFTWISE_HOT __m512i interleave_quads(__m256i even, __m256i odd) {
    const __m512i order = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    return _mm512_permutex2var_epi32(_mm512_castsi256_si512(even), order, _mm512_castsi256_si512(odd));
}

// A group's quads as quad pairs.
template <bool Nibbles, bool SixBits>
DRAFTWISE_HOT void quad_pairs_of(const uint8_t* packed, __m512i* pairs) {
    __m256i weights[8];
    unpack_quants<Nibbles, SixBits>(packed, weights);
    for (int p = 0; p < 4; ++p) pairs[p] = interleave_quads(weights[2 * p], weights[2 * p + 1]);
}

// A row's integer sums over a group's four quad pairs (its 32 bytes at ``values``), per lane. Signed quants: the
// activations go in as unsigned bytes a + 128 (the dot product takes one unsigned side), so each lane holds its sum
// plus 128 times its weights' sum, which the caller takes off.
template <bool Signed>
DRAFTWISE_HOT __m512i quad_pair_sums(const __m512i* pairs, const int8_t* values) {
    __m512i sums = _mm512_setzero_si512();
    for (int p = 0; p < 4; ++p) {
        int64_t eight;
        std::memcpy(&eight, values + 8 * p, sizeof(eight));
        const __m512i activations = _mm512_set1_epi64(eight);
        if constexpr (Signed)
            sums = _mm512_dpbusd_epi32(sums, _mm512_xor_si512(activations, _mm512_set1_epi8(-128)), pairs[p]);
        else
            sums = _mm512_dpbusd_epi32(sums, pairs[p], activations);
    }
    return sums;
}

// Output j's sum from lanes 2j and 2j + 1.
DRAFTWISE_HOT __m256i add_lane_pairs(__m512i sums) {
    return _mm512_cvtepi64_epi32(_mm512_add_epi32(sums, _mm512_shuffle_epi32(sums, _MM_PERM_CDAB)));
}

template <bool Nibbles, bool SixBits, bool Signed, bool Offsets, int Scales, bool Residuals, int Rows>
void quad_pair_tile_rows(const uint8_t* tile, int64_t groups, int64_t format, const QuantizedRows& a, int64_t first,
                         const float* bias, float* y, int64_t y_stride, int64_t valid) {
    const int centre = centre_of(format);
    const RowData data(a);
    __m256 sums[Rows];
    for (int r = 0; r < Rows; ++r) sums[r] = _mm256_setzero_ps();
    GroupReader<Offsets, false, Scales> group(tile, format);
    for (int64_t g = 0; g < groups; ++g) {
        const uint8_t* packed = group.next(g);
        if (Rows < kRowsPerPass) prefetch_ahead(packed, group.bytes);
        __m512i pairs[4];
        quad_pairs_of<Nibbles, SixBits>(packed, pairs);
        // Signed quants: what the activations' bias of 128 adds to a row's fixed-point sum, 128 (256 + 1 with
        // residuals, else 256) times each output's weights' sum
        __m256i bias_term = _mm256_setzero_si256();
        if constexpr (Signed) {
            __m512i weight_sums = _mm512_setzero_si512();
            for (int p = 0; p < 4; ++p) weight_sums = _mm512_dpbusd_epi32(weight_sums, _mm512_set1_epi8(1), pairs[p]);
            bias_term = _mm256_mullo_epi32(add_lane_pairs(weight_sums), _mm256_set1_epi32(128 * (Residuals ? 257 : 256)));
        }
        const int64_t base = a.at(first, g);
#pragma GCC unroll 8
        for (int r = 0; r < Rows; ++r) {
            const int64_t at = base + r;
            // fixed_sums' integers: 256 * (quants' sum) + (residuals' sum) - centre term
            const __m512i quant_sums = quad_pair_sums<Signed>(pairs, data.quants + at * kGroup);
            __m512i lanes = _mm512_slli_epi32(quant_sums, 8);
            if (Residuals) lanes = _mm512_add_epi32(lanes, quad_pair_sums<Signed>(pairs, data.residuals + at * kGroup));
            __m256i whole = add_lane_pairs(lanes);
            if (Signed) whole = _mm256_sub_epi32(whole, bias_term);
            else if (centre != 0) whole = _mm256_sub_epi32(whole, _mm256_set1_epi32(data.centre_sums[at]));
            sums[r] = add_group_value(sums[r], group, whole, _mm256_setzero_si256(), data.scales[at],
                                      data.scaled_sums[at]);
        }
    }
    store_rows<Rows>(sums, first, bias, y, y_stride, valid);
}

// Tile pairs, for calls of kTilePairsFromRows rows or more (kTilePairsFromRowsWithResiduals with 16-bit
// activations): the quads of two neighbouring tiles side by side in one vector (tile t's eight outputs in lanes 0-7,
// tile t + 1's in lanes 8-15) fed by one broadcast of a row's activations, and the float32 steps of a group and row on
// sixteen outputs a vector. Each lane sums exactly the integers tile_rows takes (formats with two scales a group, Q6_K,
// sum quads 0-3 and 4-7 apart, as tile_rows does) and the float32 steps are add_group_value's in the same order:
// bitwise the same products. Measured on a two-core Zen 5
// against the kernels above (8960 x 1536, 8-bit activations, weights in cache): 8 and 16 rows Q4_1 1.6-1.9x, Q4_K
// 1.65-1.75x, Q6_K 1.15-1.2x faster; Qwen2.5-Coder-1.5B Q4_K_M forwards (weights streaming from memory) of 16 rows
// (8-bit) 1.45x, of 8 rows (16-bit) 1.25-1.35x. Since the far prefetch (prefetch_ahead) they win from four rows too
// (Qwen2.5-Coder-1.5B Q4_K_M forwards of 4 / 5 rows 35.5 / 38.6 -> 29.1 / 29.0 ms with 8-bit activations, 39.7 /
// 48.7 -> 34.6 / 36.9 with 16-bit); at two rows they still lose (25.4 -> 28.2 ms). At three rows they win with 16-bit
// activations (33.1-35.3 -> 26.8-27.8 ms) and lose with 8-bit ones (25.6-26.0 -> 27.7-28.3).
constexpr int64_t kTilePairsFromRows = 4;
constexpr int64_t kTilePairsFromRowsWithResiduals = 3;

DRAFTWISE_HOT __m512 joined(__m256 first, __m256 second) {
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(first)), _mm256_castps_pd(second), 1));
}

// A group's quads of both tiles as vectors of sixteen outputs: vector k holds inputs 4k..4k+3 of the first tile's 8
// outputs at lanes 0-7 and of the second's at lanes 8-15 (unpack_quants's vectors of the two tiles side by side), so
// that a row's dot products leave every output's sum in a lane of its own.
template <bool Nibbles, bool SixBits>
DRAFTWISE_HOT void sixteen_output_quads(const uint8_t* first, const uint8_t* second, __m512i* weights) {
    const auto both = [&](int64_t offset) {
        return _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(first + offset))),
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(second + offset)), 1);
    };
    if (Nibbles || SixBits) {
        const __m512i low_nibbles = _mm512_set1_epi8(15);
        for (int k = 0; k < 4; ++k) {
            const __m512i bytes = both(32 * k);
            weights[k] = _mm512_and_si512(bytes, low_nibbles);
            weights[k + 4] = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low_nibbles);
        }
        if (SixBits) {  // each quad's top two bits, moved to bits 4-5 of its bytes
            const __m512i top_bits = _mm512_set1_epi8(0x30);
            for (int m = 0; m < 2; ++m) {
                const __m512i plane = both(128 + 32 * m);
                weights[4 * m] = _mm512_or_si512(weights[4 * m], _mm512_and_si512(_mm512_slli_epi16(plane, 4), top_bits));
                weights[4 * m + 1] = _mm512_or_si512(weights[4 * m + 1], _mm512_and_si512(_mm512_slli_epi16(plane, 2), top_bits));
                weights[4 * m + 2] = _mm512_or_si512(weights[4 * m + 2], _mm512_and_si512(plane, top_bits));
                weights[4 * m + 3] = _mm512_or_si512(weights[4 * m + 3], _mm512_and_si512(_mm512_srli_epi16(plane, 2), top_bits));
            }
        }
    } else {
        for (int k = 0; k < 8; ++k) weights[k] = both(32 * k);
    }
}

// A row's integer sums over quads [Begin, End) of sixteen_output_quads's vectors, its bytes at ``values`` (signed
// quants: as unsigned bytes a + 128), per output. (Two sums, of even and odd quads, added last: the same integers
// with dependency chains half as long.)
template <bool Signed, int Begin, int End>
DRAFTWISE_HOT __m512i sixteen_output_sums(const __m512i* weights, const int8_t* values) {
    __m512i sums[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
    for (int k = Begin; k < End; ++k) {
        int32_t four;
        std::memcpy(&four, values + 4 * k, sizeof(four));
        const __m512i activations = _mm512_set1_epi32(four);
        __m512i& to = sums[(k - Begin) % 2];
        if constexpr (Signed)
            to = _mm512_dpbusd_epi32(to, _mm512_xor_si512(activations, _mm512_set1_epi8(-128)), weights[k]);
        else
            to = _mm512_dpbusd_epi32(to, weights[k], activations);
    }
    return End - Begin > 1 ? _mm512_add_epi32(sums[0], sums[1]) : sums[0];
}

// A row's fixed-point sums (256 * quants' + residuals') over quads [Begin, End), per output.
template <bool Signed, bool Residuals, int Begin, int End>
DRAFTWISE_HOT __m512i sixteen_output_fixed_sums(const __m512i* weights, const int8_t* quants, const int8_t* residuals) {
    // (named first: without optimisation the shift is a macro, whose arguments a template's comma would split)
    const __m512i quant_sums = sixteen_output_sums<Signed, Begin, End>(weights, quants);
    __m512i whole = _mm512_slli_epi32(quant_sums, 8);
    if (Residuals) whole = _mm512_add_epi32(whole, sixteen_output_sums<Signed, Begin, End>(weights, residuals));
    return whole;
}

// The rows [first, first + Rows) over tiles ``tile`` and ``tile + tile_bytes``; the second tile's first
// ``second_valid`` outputs are stored.
template <bool Nibbles, bool SixBits, bool Signed, bool Offsets, bool Halves, int Scales, bool Residuals, int Rows>
void tile_pair_rows(const uint8_t* tile, int64_t tile_bytes, int64_t groups, int64_t format, const QuantizedRows& a,
                    int64_t first, const float* bias, float* y, int64_t y_stride, int64_t second_valid) {
    const int centre = centre_of(format);
    const RowData data(a);
    __m512 sums[Rows];
    for (int r = 0; r < Rows; ++r) sums[r] = _mm512_setzero_ps();
    GroupReader<Offsets, Halves, Scales> group_a(tile, format), group_b(tile + tile_bytes, format);
    for (int64_t g = 0; g < groups; ++g) {
        const uint8_t* packed_a = group_a.next(g);
        const uint8_t* packed_b = group_b.next(g);
        // (on every pass: with this few instructions a byte, 8-row passes wait on memory too; Qwen2.5-Coder-1.5B
        // forwards of 8 rows measured 1.4-1.9x slower without)
        prefetch_ahead(packed_a, group_a.bytes);
        prefetch_ahead(packed_b, group_b.bytes);
        __m512i weights[8];
        sixteen_output_quads<Nibbles, SixBits>(packed_a, packed_b, weights);
        // Signed quants: what the activations' bias of 128 adds to a row's fixed-point sum, 128 (256 + 1 with
        // residuals, else 256) times each output's weights' sum
        __m512i bias_low = _mm512_setzero_si512(), bias_high = _mm512_setzero_si512();
        if constexpr (Signed) {
            const __m512i ones = _mm512_set1_epi8(1);
            const __m512i factor = _mm512_set1_epi32(128 * (Residuals ? 257 : 256));
            __m512i low = _mm512_setzero_si512(), high = _mm512_setzero_si512();
            for (int k = 0; k < 8; ++k) {
                __m512i& to = Halves && k >= 4 ? high : low;
                to = _mm512_dpbusd_epi32(to, ones, weights[k]);
            }
            bias_low = _mm512_mullo_epi32(low, factor);
            if (Halves) bias_high = _mm512_mullo_epi32(high, factor);
        }
        const __m512 scale = joined(group_a.scale, group_b.scale);
        const __m512 scale_high = Halves ? joined(group_a.scale_high, group_b.scale_high) : _mm512_setzero_ps();
        const __m512 offset = Offsets ? joined(group_a.offset, group_b.offset) : _mm512_setzero_ps();
        const int64_t base = a.at(first, g);
#pragma GCC unroll 8
        for (int r = 0; r < Rows; ++r) {
            const int64_t at = base + r;
            const int8_t* q = data.quants + at * kGroup;
            const int8_t* residual = data.residuals + at * kGroup;
            __m512 value;
            if constexpr (Halves) {
                __m512i low = sixteen_output_fixed_sums<Signed, Residuals, 0, 4>(weights, q, residual);
                __m512i high = sixteen_output_fixed_sums<Signed, Residuals, 4, 8>(weights, q, residual);
                if (Signed) {
                    low = _mm512_sub_epi32(low, bias_low);
                    high = _mm512_sub_epi32(high, bias_high);
                } else if (centre != 0) {
                    low = _mm512_sub_epi32(low, _mm512_set1_epi32(data.centre_halves[2 * at]));
                    high = _mm512_sub_epi32(high, _mm512_set1_epi32(data.centre_halves[2 * at + 1]));
                }
                value = _mm512_add_ps(_mm512_mul_ps(scale, _mm512_cvtepi32_ps(low)),
                                      _mm512_mul_ps(scale_high, _mm512_cvtepi32_ps(high)));
            } else {
                __m512i whole = sixteen_output_fixed_sums<Signed, Residuals, 0, 8>(weights, q, residual);
                if (Signed) whole = _mm512_sub_epi32(whole, bias_low);
                else if (centre != 0) whole = _mm512_sub_epi32(whole, _mm512_set1_epi32(data.centre_sums[at]));
                value = _mm512_mul_ps(scale, _mm512_cvtepi32_ps(whole));
            }
            // add_group_value's steps
            value = _mm512_mul_ps(value, _mm512_set1_ps(data.scales[at]));
            if (Offsets) value = _mm512_add_ps(value, _mm512_mul_ps(offset, _mm512_set1_ps(data.scaled_sums[at])));
            sums[r] = _mm512_add_ps(sums[r], value);
        }
    }
    __m256 first_sums[Rows], second_sums[Rows];
    for (int r = 0; r < Rows; ++r) {
        first_sums[r] = _mm512_castps512_ps256(sums[r]);
        second_sums[r] = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(sums[r]), 1));
    }
    store_rows<Rows>(first_sums, first, bias, y, y_stride, kTile);
    store_rows<Rows>(second_sums, first, bias == nullptr ? nullptr : bias + kTile, y + kTile, y_stride, second_valid);
}

template <bool Nibbles, bool SixBits, bool Signed, bool Offsets, bool Halves, int Scales>
void tile_pair_all_rows(const uint8_t* tile, int64_t tile_bytes, int64_t groups, int64_t format, const QuantizedRows& a,
                        int64_t rows, const float* bias, float* y, int64_t y_stride, int64_t second_valid) {
    const auto passes = [&](auto residuals) {
        in_passes<true>(rows, [&](int64_t first, auto count) {
            tile_pair_rows<Nibbles, SixBits, Signed, Offsets, Halves, Scales, decltype(residuals)::value,
                           decltype(count)::value>(tile, tile_bytes, groups, format, a, first, bias, y, y_stride,
                                                   second_valid);
        });
    };
    if (a.with_residuals) passes(std::true_type{});
    else passes(std::false_type{});
}

template <bool Nibbles, bool SixBits, bool Signed, bool Offsets, int Scales, bool Residuals>
void quad_pair_rows(const uint8_t* tile, int64_t groups, int64_t format, const QuantizedRows& a, int64_t rows,
                    const float* bias, float* y, int64_t y_stride, int64_t valid) {
    in_passes<true>(rows, [&](int64_t first, auto count) {
        quad_pair_tile_rows<Nibbles, SixBits, Signed, Offsets, Scales, Residuals, decltype(count)::value>(
            tile, groups, format, a, first, bias, y, y_stride, valid);
    });
}
#endif

// Every row of a call through tile_rows: kRowsPerPass at a time, then four, then the rest (on CPUs with AVX-512 and
// VNNI through paired_rows for formats with two scales a group, and from two rows through quad_pair_rows for those
// with one).
template <bool Nibbles, bool SixBits, bool Signed, bool Offsets, bool Halves, int Scales, bool Residuals>
void narrow_rows(const uint8_t* tile, int64_t groups, int64_t format, const QuantizedRows& a, int64_t rows,
                 const float* bias, float* y, int64_t y_stride, int64_t valid) {
#if defined(DRAFTWISE_VNNI512)
    if constexpr (Halves) {  // (see paired_tile_rows)
        paired_rows<Nibbles, SixBits, Signed, Offsets, Halves, Scales, Residuals>(tile, groups, format, a, rows, bias, y,
                                                                                 y_stride, valid);
        return;
    } else if (rows >= kQuadPairsFromRows) {
        quad_pair_rows<Nibbles, SixBits, Signed, Offsets, Scales, Residuals>(tile, groups, format, a, rows, bias, y,
                                                                            y_stride, valid);
        return;
    }
#endif
    in_passes(rows, [&](int64_t first, auto count) {
        tile_rows<Nibbles, SixBits, Signed, Offsets, Halves, Scales, Residuals, decltype(count)::value>(
            tile, groups, format, a, first, bias, y, y_stride, valid);
    });
}

template <bool Nibbles, bool SixBits, bool Signed, bool Offsets, bool Halves, int Scales>
void tile_all_rows(const uint8_t* tile, int64_t groups, int64_t format, const QuantizedRows& a,
                   int64_t rows, const float* bias, float* y, int64_t y_stride, int64_t valid, WideTile& wide) {
    if constexpr (Signed) {
        if (!a.wide.empty()) {
            widen_signed_tile(tile, groups, format, wide);
            int64_t first = 0;
            for (; first + kWideRowsPerPass <= rows; first += kWideRowsPerPass)
                wide_rows<Offsets, Halves, Scales, kWideRowsPerPass>(tile, wide, groups, format, a, first, bias, y,
                                                                     y_stride, valid);
            for (; first < rows; ++first)
                wide_rows<Offsets, Halves, Scales, 1>(tile, wide, groups, format, a, first, bias, y, y_stride, valid);
            return;
        }
    }
    if (a.with_residuals)
        narrow_rows<Nibbles, SixBits, Signed, Offsets, Halves, Scales, true>(tile, groups, format, a, rows, bias, y,
                                                                             y_stride, valid);
    else
        narrow_rows<Nibbles, SixBits, Signed, Offsets, Halves, Scales, false>(tile, groups, format, a, rows, bias, y,
                                                                              y_stride, valid);
}

using TileProduct = void (*)(const uint8_t*, int64_t, int64_t, const QuantizedRows&, int64_t, const float*, float*,
                             int64_t, int64_t, WideTile&);

// A kernel family's instance for a format's bits, ``Kernel<Nibbles, SixBits, Signed, Offsets, Halves,
// Scales>::function`` (each flag a compile-time constant, so each instance is compiled for its format).
template <template <bool, bool, bool, bool, bool, int> class Kernel>
auto kernel_for(int64_t format) {
    const auto with_floats = [format](auto nibbles, auto six_bits, auto is_signed, auto scales) {
        constexpr bool kNib = decltype(nibbles)::value, kSix = decltype(six_bits)::value;
        constexpr bool kSig = decltype(is_signed)::value;
        constexpr int kScales = decltype(scales)::value;
        const bool offsets = format & kOffsets, halves = format & kHalves;
        if (offsets)
            return halves ? Kernel<kNib, kSix, kSig, true, true, kScales>::function
                          : Kernel<kNib, kSix, kSig, true, false, kScales>::function;
        return halves ? Kernel<kNib, kSix, kSig, false, true, kScales>::function
                      : Kernel<kNib, kSix, kSig, false, false, kScales>::function;
    };
    const auto with_quants = [&](auto scales) {
        using Yes = std::true_type;
        using No = std::false_type;
        if (format & kNibbles) return with_floats(Yes{}, No{}, No{}, scales);
        if (format & kSixBits) return with_floats(No{}, Yes{}, No{}, scales);
        return format & kSigned ? with_floats(No{}, No{}, Yes{}, scales) : with_floats(No{}, No{}, No{}, scales);
    };
    if (format & kFactored) return with_quants(std::integral_constant<int, kFactoredScales>{});
    return format & kHalfFloats ? with_quants(std::integral_constant<int, kHalfScales>{})
                                : with_quants(std::integral_constant<int, kFloatScales>{});
}

template <bool Nibbles, bool SixBits, bool Signed, bool Offsets, bool Halves, int Scales>
struct TileKernel {
    static constexpr TileProduct function = tile_all_rows<Nibbles, SixBits, Signed, Offsets, Halves, Scales>;
};

TileProduct tile_product(int64_t format) { return kernel_for<TileKernel>(format); }

#if defined(DRAFTWISE_VNNI512)
using TilePairProduct = void (*)(const uint8_t*, int64_t, int64_t, int64_t, const QuantizedRows&, int64_t,
                                 const float*, float*, int64_t, int64_t);

template <bool Nibbles, bool SixBits, bool Signed, bool Offsets, bool Halves, int Scales>
struct TilePairKernel {
    static constexpr TilePairProduct function = tile_pair_all_rows<Nibbles, SixBits, Signed, Offsets, Halves, Scales>;
};

TilePairProduct tile_pair_product(int64_t format) { return kernel_for<TilePairKernel>(format); }
#endif
#else
// The same integer sums and float32 operations one output at a time.
void tile_all_rows_scalar(const uint8_t* tile, int64_t groups, int64_t format, const QuantizedRows& a,
                          int64_t rows, const float* bias, float* y, int64_t y_stride, int64_t valid) {
    const bool halves = format & kHalves;
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t j = 0; j < valid; ++j) {
            float sum = 0.0f;
            for (int64_t g = 0; g < groups; ++g) {
                const uint8_t* packed = group_quants(group_start(tile, g, format), format);
                const int64_t at = a.at(r, g);
                const int8_t* q = a.quants.data() + at * kGroup;
                const int8_t* residual = a.residuals.data() + at * kGroup;
                int32_t totals[2] = {0, 0};
                for (int64_t i = 0; i < kGroup; ++i) {
                    const int64_t quad = i / 4, lane = i % 4;
                    int32_t weight;
                    if (format & (kNibbles | kSixBits)) {
                        const uint8_t byte = packed[32 * (quad % 4) + 4 * j + lane];
                        weight = quad < 4 ? byte & 15 : byte >> 4;
                        if (format & kSixBits)
                            weight |= ((packed[128 + 32 * (quad / 4) + 4 * j + lane] >> (2 * (quad % 4))) & 3) << 4;
                    } else if (format & kSigned) {
                        weight = static_cast<int8_t>(packed[32 * quad + 4 * j + lane]);
                    } else {
                        weight = packed[32 * quad + 4 * j + lane];
                    }
                    totals[i / kHalf] += weight * (256 * q[i] + residual[i]);
                }
                for (int h = 0; h < 2; ++h) totals[h] -= a.centre_halves[2 * at + h];
                const float scale = group_float(tile, g, format, 0, j);
                float value = halves ? scale * static_cast<float>(totals[0]) +
                                           group_float(tile, g, format, 1, j) * static_cast<float>(totals[1])
                                     : scale * static_cast<float>(totals[0] + totals[1]);
                value = value * a.scales[at];
                if (format & kOffsets) value = value + group_float(tile, g, format, 2, j) * a.scaled_sums[at];
                sum = sum + value;
            }
            y[r * y_stride + j] = bias != nullptr ? sum + bias[j] : sum;
        }
}
#endif


// Super-block products: 8-bit activations over factored formats (the k-quants: Q4_K, Q5_K, Q6_K and their stacks),
// as llama.cpp's Q8_K dot products take them but with one scale per kScaleGroups groups (128 inputs) where Q8_K takes
// one per 256. A row's activations are quantised per block of 128 inputs (one d = max |x| / 127 for its 4 groups; q as
// above, no residuals), so the super-block's small integer scales and offsets apply to exact integer sums and the
// float32 steps run once per block instead of once per group (those steps weighed about as much as the dot products: a
// Qwen2.5-Coder-1.5B Q4_K_M forward of 8 rows on a Zen 4 spent 83 ms with them per group, 51 with the Q4_K products'
// steps left out altogether, 62 so). One scale per 256 inputs cost the same and kept the float model's top token less
// often than llama.cpp (96.5 % against 96.8 % of 2277 positions); per 128, 97.6 %. Per output and block:
//
//   I = sum over its 8 half groups h of small_scale_h * (sum over h's inputs of quant * q)   (exact int32)
//   M = sum over its 4 groups g of small_offset_g * (sum over g's inputs of q)                (exact int32)
//   value = super_scale * I, value = value * d, with offsets value = value + (super_offset * M) * d,
//   and the output's sum += value, block after block; the bias last.
//
// (quant is the file's signed quant: the centre's share, centre * small_scale_h * sum of q over h, is taken off
// inside I as pairs of int16 products.) Each step is one float32 rounding in one fixed order per row: a row is
// bitwise its one-row product, whatever the kernel that runs it.

DRAFTWISE_HOT int32_t int16_pair(int32_t low, int32_t high) {
    return (low & 0xFFFF) | static_cast<int32_t>(static_cast<uint32_t>(high) << 16);
}

#if defined(__AVX2__)
// Each 32-bit lane of ``sums`` plus the products of its two int16 halves of ``a`` and ``b``, exact (one instruction
// with VNNI).
DRAFTWISE_HOT __m256i add_pair_products(__m256i sums, __m256i a, __m256i b) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpwssd_epi32(sums, a, b);
#elif defined(__AVXVNNI__)
    return _mm256_dpwssd_avx_epi32(sums, a, b);
#else
    return _mm256_add_epi32(sums, _mm256_madd_epi16(a, b));
#endif
}

// Eight int8 as int32 lanes.
DRAFTWISE_HOT __m256i eight_small(const uint8_t* small) {
    return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(small)));
}

// Lanes of int16 pairs (low's low 16 bits, high's).
DRAFTWISE_HOT __m256i pairs_of(__m256i low, __m256i high) {
    return _mm256_or_si256(_mm256_and_si256(low, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32(high, 16));
}

// The rows [first, first + Rows) over one tile of 8 outputs.
template <bool Nibbles, bool SixBits, bool Offsets, bool Halves, int Rows>
void super_tile_rows(const uint8_t* tile, int64_t groups, int64_t format, const QuantizedRows& a, int64_t first,
                     const float* bias, float* y, int64_t y_stride, int64_t valid) {
    const int centre = centre_of(format);
    const int64_t bytes = group_bytes(format);
    __m256 sums[Rows];
    for (int r = 0; r < Rows; ++r) sums[r] = _mm256_setzero_ps();
    const uint8_t* source = tile;
    for (int64_t start = 0; start < groups; start += kSuperGroups) {
        const float* header = reinterpret_cast<const float*>(source);
        const __m256 super_scale = _mm256_loadu_ps(header);
        const __m256 super_offset = Offsets ? _mm256_loadu_ps(header + kTile) : _mm256_setzero_ps();
        source += header_bytes(format);
        __m256i integers[Rows], offset_sums[Rows];
        for (int r = 0; r < Rows; ++r) integers[r] = offset_sums[r] = _mm256_setzero_si256();
        __m256i even_offsets = _mm256_setzero_si256();
        for (int64_t k = 0; k < kSuperGroups; ++k, source += bytes) {
            const int64_t g = start + k;
            const uint8_t* packed = group_quants(source, format);
            if (Rows < kRowsPerPass) prefetch_ahead(packed, bytes);
            const __m256i scale = eight_small(source);
            const __m256i scale_high = Halves ? eight_small(source + kTile) : scale;
            // the centre's share: -centre * small scale of each half, as int16 pairs (|centre * scale| < 2^13)
            const __m256i centre_pairs = pairs_of(_mm256_mullo_epi32(scale, _mm256_set1_epi32(-centre)),
                                                  _mm256_mullo_epi32(scale_high, _mm256_set1_epi32(-centre)));
            __m256i offset_pairs = _mm256_setzero_si256();
            if (Offsets) {
                const __m256i offsets = eight_small(source + (Halves ? 2 : 1) * kTile);
                if (k % 2 == 0) even_offsets = offsets;
                else offset_pairs = pairs_of(even_offsets, offsets);
            }
            __m256i weights[8], magnitudes[8];
            unpack_quants<Nibbles, SixBits>(packed, weights);
            const int64_t base = a.at(first, g);
#pragma GCC unroll 8
            for (int r = 0; r < Rows; ++r) {
                const int8_t* q = a.quants.data() + (base + r) * kGroup;
                if (Halves) {
                    const __m256i low = quad_sums<Nibbles, SixBits, false, 0, 4>(weights, magnitudes, q);
                    const __m256i high = quad_sums<Nibbles, SixBits, false, 4, 8>(weights, magnitudes, q);
                    integers[r] = _mm256_add_epi32(integers[r], _mm256_add_epi32(_mm256_mullo_epi32(low, scale),
                                                                                 _mm256_mullo_epi32(high, scale_high)));
                } else {
                    const __m256i whole = quad_sums<Nibbles, SixBits, false, 0, 8>(weights, magnitudes, q);
                    integers[r] = _mm256_add_epi32(integers[r], _mm256_mullo_epi32(whole, scale));
                }
                if (centre != 0)
                    integers[r] = add_pair_products(integers[r], centre_pairs, _mm256_set1_epi32(a.half_pairs[base + r]));
                if (Offsets && k % 2 == 1)
                    offset_sums[r] = add_pair_products(offset_sums[r], offset_pairs,
                                                       _mm256_set1_epi32(a.group_pairs[(g / 2) * a.rows + first + r]));
            }
            if (k % kScaleGroups != kScaleGroups - 1) continue;
#pragma GCC unroll 8
            for (int r = 0; r < Rows; ++r) {  // the float32 steps of the groups sharing an activation scale
                const __m256 d = _mm256_set1_ps(a.scales[base + r]);
                __m256 value = _mm256_mul_ps(_mm256_mul_ps(super_scale, _mm256_cvtepi32_ps(integers[r])), d);
                if (Offsets)
                    value = _mm256_add_ps(value, _mm256_mul_ps(_mm256_mul_ps(super_offset, _mm256_cvtepi32_ps(offset_sums[r])), d));
                sums[r] = _mm256_add_ps(sums[r], value);
                integers[r] = offset_sums[r] = _mm256_setzero_si256();
            }
        }
    }
    store_rows<Rows>(sums, first, bias, y, y_stride, valid);
}

template <bool Nibbles, bool SixBits, bool Offsets, bool Halves>
void super_all_rows(const uint8_t* tile, int64_t groups, int64_t format, const QuantizedRows& a, int64_t rows,
                    const float* bias, float* y, int64_t y_stride, int64_t valid) {
    in_passes(rows, [&](int64_t first, auto count) {
        super_tile_rows<Nibbles, SixBits, Offsets, Halves, decltype(count)::value>(tile, groups, format, a, first, bias,
                                                                                  y, y_stride, valid);
    });
}

#if defined(DRAFTWISE_VNNI512)
// Sixteen int8 (eight at ``first``, eight at ``second``) as int32 lanes.
DRAFTWISE_HOT __m512i sixteen_small(const uint8_t* first, const uint8_t* second) {
    return _mm512_cvtepi8_epi32(_mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(first)),
                                                   _mm_loadl_epi64(reinterpret_cast<const __m128i*>(second))));
}

DRAFTWISE_HOT __m512i pairs_of(__m512i low, __m512i high) {
    return _mm512_or_si512(_mm512_and_si512(low, _mm512_set1_epi32(0xFFFF)), _mm512_slli_epi32(high, 16));
}

// super_tile_rows over two neighbouring tiles at once, sixteen outputs a vector (as tile_pair_rows): the same integers
// and float32 steps in each output's lane.
template <bool Nibbles, bool SixBits, bool Offsets, bool Halves, int Rows>
void super_tile_pair_rows(const uint8_t* tile, int64_t tile_bytes, int64_t groups, int64_t format,
                          const QuantizedRows& a, int64_t first, const float* bias, float* y, int64_t y_stride,
                          int64_t second_valid) {
    const int centre = centre_of(format);
    const int64_t bytes = group_bytes(format);
    __m512 sums[Rows];
    for (int r = 0; r < Rows; ++r) sums[r] = _mm512_setzero_ps();
    const uint8_t* source_a = tile;
    const uint8_t* source_b = tile + tile_bytes;
    for (int64_t start = 0; start < groups; start += kSuperGroups) {
        const float* header_a = reinterpret_cast<const float*>(source_a);
        const float* header_b = reinterpret_cast<const float*>(source_b);
        const __m512 super_scale = joined(_mm256_loadu_ps(header_a), _mm256_loadu_ps(header_b));
        const __m512 super_offset = Offsets ? joined(_mm256_loadu_ps(header_a + kTile), _mm256_loadu_ps(header_b + kTile))
                                            : _mm512_setzero_ps();
        source_a += header_bytes(format);
        source_b += header_bytes(format);
        __m512i integers[Rows], offset_sums[Rows];
        for (int r = 0; r < Rows; ++r) integers[r] = offset_sums[r] = _mm512_setzero_si512();
        __m512i even_offsets = _mm512_setzero_si512();
        for (int64_t k = 0; k < kSuperGroups; ++k, source_a += bytes, source_b += bytes) {
            const int64_t g = start + k;
            const uint8_t* packed_a = group_quants(source_a, format);
            const uint8_t* packed_b = group_quants(source_b, format);
            prefetch_ahead(packed_a, bytes);
            prefetch_ahead(packed_b, bytes);
            const __m512i scale = sixteen_small(source_a, source_b);
            const __m512i scale_high = Halves ? sixteen_small(source_a + kTile, source_b + kTile) : scale;
            const __m512i centre_pairs = pairs_of(_mm512_mullo_epi32(scale, _mm512_set1_epi32(-centre)),
                                                  _mm512_mullo_epi32(scale_high, _mm512_set1_epi32(-centre)));
            __m512i offset_pairs = _mm512_setzero_si512();
            if (Offsets) {
                const int64_t at = (Halves ? 2 : 1) * kTile;
                const __m512i offsets = sixteen_small(source_a + at, source_b + at);
                if (k % 2 == 0) even_offsets = offsets;
                else offset_pairs = pairs_of(even_offsets, offsets);
            }
            __m512i weights[8];
            sixteen_output_quads<Nibbles, SixBits>(packed_a, packed_b, weights);
            const int64_t base = a.at(first, g);
#pragma GCC unroll 8
            for (int r = 0; r < Rows; ++r) {
                const int8_t* q = a.quants.data() + (base + r) * kGroup;
                if (Halves) {
                    const __m512i low = sixteen_output_sums<false, 0, 4>(weights, q);
                    const __m512i high = sixteen_output_sums<false, 4, 8>(weights, q);
                    integers[r] = _mm512_add_epi32(integers[r], _mm512_add_epi32(_mm512_mullo_epi32(low, scale),
                                                                                 _mm512_mullo_epi32(high, scale_high)));
                } else {
                    const __m512i whole = sixteen_output_sums<false, 0, 8>(weights, q);
                    integers[r] = _mm512_add_epi32(integers[r], _mm512_mullo_epi32(whole, scale));
                }
                if (centre != 0)
                    integers[r] = _mm512_dpwssd_epi32(integers[r], centre_pairs, _mm512_set1_epi32(a.half_pairs[base + r]));
                if (Offsets && k % 2 == 1)
                    offset_sums[r] = _mm512_dpwssd_epi32(offset_sums[r], offset_pairs,
                                                         _mm512_set1_epi32(a.group_pairs[(g / 2) * a.rows + first + r]));
            }
            if (k % kScaleGroups != kScaleGroups - 1) continue;
#pragma GCC unroll 8
            for (int r = 0; r < Rows; ++r) {
                const __m512 d = _mm512_set1_ps(a.scales[base + r]);
                __m512 value = _mm512_mul_ps(_mm512_mul_ps(super_scale, _mm512_cvtepi32_ps(integers[r])), d);
                if (Offsets)
                    value = _mm512_add_ps(value, _mm512_mul_ps(_mm512_mul_ps(super_offset, _mm512_cvtepi32_ps(offset_sums[r])), d));
                sums[r] = _mm512_add_ps(sums[r], value);
                integers[r] = offset_sums[r] = _mm512_setzero_si512();
            }
        }
    }
    __m256 first_sums[Rows], second_sums[Rows];
    for (int r = 0; r < Rows; ++r) {
        first_sums[r] = _mm512_castps512_ps256(sums[r]);
        second_sums[r] = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(sums[r]), 1));
    }
    store_rows<Rows>(first_sums, first, bias, y, y_stride, kTile);
    store_rows<Rows>(second_sums, first, bias == nullptr ? nullptr : bias + kTile, y + kTile, y_stride, second_valid);
}

template <bool Nibbles, bool SixBits, bool Offsets, bool Halves>
void super_pair_all_rows(const uint8_t* tile, int64_t tile_bytes, int64_t groups, int64_t format,
                         const QuantizedRows& a, int64_t rows, const float* bias, float* y, int64_t y_stride,
                         int64_t second_valid) {
    in_passes<true>(rows, [&](int64_t first, auto count) {
        super_tile_pair_rows<Nibbles, SixBits, Offsets, Halves, decltype(count)::value>(
            tile, tile_bytes, groups, format, a, first, bias, y, y_stride, second_valid);
    });
}
#endif

using SuperProduct = void (*)(const uint8_t*, int64_t, int64_t, const QuantizedRows&, int64_t, const float*, float*,
                              int64_t, int64_t);

// The super-block kernel family's instance for a format's bits (unsigned quants: the k-quants' centres fit them).
template <template <bool, bool, bool, bool> class Kernel>
auto super_kernel_for(int64_t format) {
    const auto with_quants = [format](auto nibbles, auto six_bits) {
        constexpr bool kNib = decltype(nibbles)::value, kSix = decltype(six_bits)::value;
        const bool offsets = format & kOffsets, halves = format & kHalves;
        if (offsets)
            return halves ? Kernel<kNib, kSix, true, true>::function : Kernel<kNib, kSix, true, false>::function;
        return halves ? Kernel<kNib, kSix, false, true>::function : Kernel<kNib, kSix, false, false>::function;
    };
    if (format & kNibbles) return with_quants(std::true_type{}, std::false_type{});
    if (format & kSixBits) return with_quants(std::false_type{}, std::true_type{});
    return with_quants(std::false_type{}, std::false_type{});
}

template <bool Nibbles, bool SixBits, bool Offsets, bool Halves>
struct SuperKernel {
    static constexpr SuperProduct function = super_all_rows<Nibbles, SixBits, Offsets, Halves>;
};

#if defined(DRAFTWISE_VNNI512)
using SuperPairProduct = void (*)(const uint8_t*, int64_t, int64_t, int64_t, const QuantizedRows&, int64_t,
                                  const float*, float*, int64_t, int64_t);

template <bool Nibbles, bool SixBits, bool Offsets, bool Halves>
struct SuperPairKernel {
    static constexpr SuperPairProduct function = super_pair_all_rows<Nibbles, SixBits, Offsets, Halves>;
};
#endif
#endif

// The quant of output j (of 8), input i of a group's packed bytes, centre included (unsigned layouts).
inline int32_t stored_quant(const uint8_t* packed, int64_t format, int64_t j, int64_t i) {
    const int64_t quad = i / 4, lane = i % 4;
    if (format & (kNibbles | kSixBits)) {
        const uint8_t byte = packed[32 * (quad % 4) + 4 * j + lane];
        int32_t weight = quad < 4 ? byte & 15 : byte >> 4;
        if (format & kSixBits) weight |= ((packed[128 + 32 * (quad / 4) + 4 * j + lane] >> (2 * (quad % 4))) & 3) << 4;
        return weight;
    }
    if (format & kSigned) return static_cast<int8_t>(packed[32 * quad + 4 * j + lane]);
    return packed[32 * quad + 4 * j + lane];
}

// The super-block arithmetic one output at a time (CPUs without AVX2).
void super_all_rows_scalar(const uint8_t* tile, int64_t groups, int64_t format, const QuantizedRows& a, int64_t rows,
                           const float* bias, float* y, int64_t y_stride, int64_t valid) {
    const int centre = centre_of(format);
    const bool halves = format & kHalves, offsets = format & kOffsets;
    const int64_t offset_slot = (halves ? 2 : 1) * kTile;
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t j = 0; j < valid; ++j) {
            float sum = 0.0f;
            for (int64_t start = 0; start < groups; start += kScaleGroups) {
                const float* header = super_floats(tile, start, format);
                int32_t integer = 0, offset_sum = 0;
                for (int64_t g = start; g < start + kScaleGroups; ++g) {
                    const uint8_t* source = group_start(tile, g, format);
                    const uint8_t* packed = group_quants(source, format);
                    const int8_t* q = a.quants.data() + a.at(r, g) * kGroup;
                    int32_t q_sums[2] = {0, 0};
                    for (int h = 0; h < 2; ++h) {
                        int32_t half = 0;
                        for (int64_t i = h * kHalf; i < (h + 1) * kHalf; ++i) {
                            half += (stored_quant(packed, format, j, i) - centre) * q[i];
                            q_sums[h] += q[i];
                        }
                        const int8_t small = reinterpret_cast<const int8_t*>(source)[(halves ? h : 0) * kTile + j];
                        integer += small * half;
                    }
                    if (offsets) offset_sum += reinterpret_cast<const int8_t*>(source)[offset_slot + j] * (q_sums[0] + q_sums[1]);
                }
                const float d = a.scales[a.at(r, start)];
                float value = header[j] * static_cast<float>(integer) * d;
                if (offsets) value = value + header[kTile + j] * static_cast<float>(offset_sum) * d;
                sum = sum + value;
            }
            y[r * y_stride + j] = bias != nullptr ? sum + bias[j] : sum;
        }
}

#undef DRAFTWISE_HOT

}  // namespace quantized_products

namespace {

// The checks of a product's arguments (before its output is allocated); returns the inputs' groups of 32.
int64_t check_quantized_product(const at::Tensor& inputs, const at::Tensor& packed, int64_t format,
                                const c10::optional<at::Tensor>& bias, int64_t out_features, int64_t activation_bits) {
    namespace qp = quantized_products;
    TORCH_CHECK(qp::valid_format(format), "format: the packing's format bits and centre");
    TORCH_CHECK(activation_bits == 8 || activation_bits == 16, "activation_bits: 8 or 16");
    TORCH_CHECK(inputs.dim() == 2 && inputs.scalar_type() == at::kFloat && inputs.stride(1) == 1,
                "inputs: (rows, in) float32, rows contiguous");
    TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                    packed.size(2) == qp::unit_bytes(format),
                "packed: (tiles, units, bytes) uint8 from the packing of this format");
    const int64_t tiles = packed.size(0);
    const int64_t groups = packed.size(1) * (format & qp::kFactored ? qp::kSuperGroups : 1);
    TORCH_CHECK(inputs.size(1) == groups * qp::kGroup, "inputs: ", groups * qp::kGroup, " features");
    TORCH_CHECK(out_features > (tiles - 1) * qp::kTile && out_features <= tiles * qp::kTile,
                "out_features: the packing's");
    if (bias.has_value() && bias->defined())
        TORCH_CHECK(bias->dim() == 1 && bias->size(0) == out_features && bias->is_contiguous() &&
                        bias->scalar_type() == at::kFloat,
                    "bias: (out,) float32");
    return groups;
}

// quantized_linear_into for 8-bit activations over a factored format: the super-block products.
void super_block_products(const at::Tensor& inputs, const at::Tensor& packed, int64_t format,
                          const c10::optional<at::Tensor>& bias, int64_t out_features, int64_t groups,
                          const at::Tensor& output) {
    namespace qp = quantized_products;
    const int64_t rows = inputs.size(0), tiles = packed.size(0);
    const qp::QuantizedRows activations(inputs.data_ptr<float>(), inputs.stride(0), rows, groups, false,
                                        qp::centre_of(format), false, true);
    const uint8_t* weights = packed.data_ptr<uint8_t>();
    const float* offsets = bias.has_value() && bias->defined() ? bias->data_ptr<float>() : nullptr;
    float* y = output.data_ptr<float>();
    const int64_t bytes = packed.size(1) * qp::unit_bytes(format);  // a tile's
    const auto columns = [&](int64_t t) { return std::min<int64_t>(qp::kTile, out_features - t * qp::kTile); };
#if defined(__AVX2__)
    const qp::SuperProduct product = qp::super_kernel_for<qp::SuperKernel>(format);
#if defined(DRAFTWISE_VNNI512)
    if (rows >= qp::kTilePairsFromRows && tiles >= 2) {
        const qp::SuperPairProduct pair_product = qp::super_kernel_for<qp::SuperPairKernel>(format);
        at::parallel_for(0, (tiles + 1) / 2, 1, [&](int64_t begin, int64_t end) {
            for (int64_t pair = begin; pair < end; ++pair) {
                const int64_t t = 2 * pair, column = t * qp::kTile;
                const float* pair_bias = offsets == nullptr ? nullptr : offsets + column;
                if (t + 1 < tiles)
                    pair_product(weights + t * bytes, bytes, groups, format, activations, rows, pair_bias, y + column,
                                 out_features, columns(t + 1));
                else  // (a last tile alone)
                    product(weights + t * bytes, groups, format, activations, rows, pair_bias, y + column,
                            out_features, columns(t));
            }
        });
        return;
    }
#endif
#endif
    at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) {
            const int64_t column = t * qp::kTile;
#if defined(__AVX2__)
            product(weights + t * bytes, groups, format, activations, rows,
                    offsets == nullptr ? nullptr : offsets + column, y + column, out_features, columns(t));
#else
            qp::super_all_rows_scalar(weights + t * bytes, groups, format, activations, rows,
                                      offsets == nullptr ? nullptr : offsets + column, y + column, out_features,
                                      columns(t));
#endif
        }
    });
}

}  // namespace

at::Tensor quantized_linear(const at::Tensor& inputs, const at::Tensor& packed, int64_t format,
                            const c10::optional<at::Tensor>& bias, int64_t out_features, int64_t activation_bits) {
    check_quantized_product(inputs, packed, format, bias, out_features, activation_bits);
    auto output = at::empty({inputs.size(0), out_features}, inputs.options());
    quantized_linear_into(inputs, packed, format, bias, out_features, activation_bits, output);
    return output;
}

void quantized_linear_into(const at::Tensor& inputs, const at::Tensor& packed, int64_t format,
                           const c10::optional<at::Tensor>& bias, int64_t out_features, int64_t activation_bits,
                           const at::Tensor& output) {
    namespace qp = quantized_products;
    const int64_t groups = check_quantized_product(inputs, packed, format, bias, out_features, activation_bits);
    const int64_t rows = inputs.size(0), tiles = packed.size(0);
    const bool biased = bias.has_value() && bias->defined();
    check_output_rows(output, rows, out_features, at::kFloat, "output");
    if (rows == 0) return;
    if (groups == 0) {
        output.narrow(0, 0, rows).zero_();
        return;
    }
    if (activation_bits == 8 && (format & qp::kFactored) && !(format & qp::kSigned)) {
        super_block_products(inputs, packed, format, bias, out_features, groups, output);
        return;
    }
#if defined(__AVX2__)
    const bool wide = !qp::kDotInstruction && activation_bits == 16 && (format & qp::kSigned) &&
                      rows >= qp::kWideFromRows;
#else
    const bool wide = false;
#endif
    const qp::QuantizedRows activations(inputs.data_ptr<float>(), inputs.stride(0), rows, groups, activation_bits == 16,
                                        qp::centre_of(format), wide);
    const uint8_t* weights = packed.data_ptr<uint8_t>();
    const float* offsets = biased ? bias->data_ptr<float>() : nullptr;
    float* y = output.data_ptr<float>();
    const int64_t bytes = packed.size(1) * qp::unit_bytes(format);  // a tile's
#if defined(__AVX2__)
    const qp::TileProduct product = qp::tile_product(format);
#endif
#if defined(DRAFTWISE_VNNI512)
    {
        if (rows >= (activation_bits == 16 ? qp::kTilePairsFromRowsWithResiduals : qp::kTilePairsFromRows) &&
            tiles >= 2) {
            const qp::TilePairProduct pair_product = qp::tile_pair_product(format);
            at::parallel_for(0, (tiles + 1) / 2, 1, [&](int64_t begin, int64_t end) {
                qp::WideTile scratch;
                for (int64_t pair = begin; pair < end; ++pair) {
                    const int64_t t = 2 * pair, column = t * qp::kTile;
                    const float* pair_bias = offsets == nullptr ? nullptr : offsets + column;
                    if (t + 1 < tiles)
                        pair_product(weights + t * bytes, bytes, groups, format, activations, rows, pair_bias,
                                     y + column, out_features,
                                     std::min<int64_t>(qp::kTile, out_features - column - qp::kTile));
                    else  // (a last tile alone)
                        product(weights + t * bytes, groups, format, activations, rows, pair_bias, y + column,
                                out_features, std::min<int64_t>(qp::kTile, out_features - column), scratch);
                }
            });
            return;
        }
    }
#endif
    at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
#if defined(__AVX2__)
        qp::WideTile scratch;
#endif
        for (int64_t t = begin; t < end; ++t) {
            const int64_t column = t * qp::kTile;
#if defined(__AVX2__)
            product(weights + t * bytes, groups, format, activations, rows,
                    offsets == nullptr ? nullptr : offsets + column, y + column, out_features,
                    std::min<int64_t>(qp::kTile, out_features - column), scratch);
#else
            qp::tile_all_rows_scalar(weights + t * bytes, groups, format, activations, rows,
                                     offsets == nullptr ? nullptr : offsets + column, y + column, out_features,
                                     std::min<int64_t>(qp::kTile, out_features - column));
#endif
        }
    });
}
