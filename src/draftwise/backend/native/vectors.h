// Sixteen-lane float arithmetic shared by the kernels: loads from every supported dtype, a fixed-order horizontal
// sum and a vector exponential. Every element goes through the same instructions wherever it sits, which is what
// makes the kernels' results independent of how many rows a call holds.
#pragma once

#include <ATen/core/Tensor.h>
#if defined(__x86_64__) || defined(_M_X64) || defined(__i386__) || defined(_M_IX86)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace draftwise {

// Sixteen floats: one AVX-512 register, two AVX2 ones, four SSE or NEON ones; GCC's vector extensions keep the
// arithmetic the same on all of them. x86 intrinsics appear only behind the macros of the vector units they need,
// each with a portable fallback, so the kernels build for x86 without AVX and for aarch64 too.
typedef float floats16 __attribute__((vector_size(64)));
typedef int32_t ints16 __attribute__((vector_size(64)));
typedef uint32_t words16 __attribute__((vector_size(64)));
typedef uint16_t halfwords16 __attribute__((vector_size(32)));
constexpr int kLanes = 16;

// The machine's own vector register of floats (16 lanes with AVX-512, 8 with AVX, 4 elsewhere). GCC lowers
// comparisons and selections of vectors wider than the machine's to one lane at a time, several times slower than
// the arithmetic: loops that compare lanes use this width.
#if defined(__AVX512F__)
constexpr int kNativeLanes = 16;
#elif defined(__AVX__)
constexpr int kNativeLanes = 8;
#else
constexpr int kNativeLanes = 4;
#endif
typedef float native_floats __attribute__((vector_size(4 * kNativeLanes)));
typedef int32_t native_ints __attribute__((vector_size(4 * kNativeLanes)));

// Calls ``function`` with a value of the C++ type of ``tensor``'s dtype (float32, bfloat16 or float16).
template <typename Function>
void dispatch(const at::Tensor& tensor, Function&& function) {
    switch (tensor.scalar_type()) {
        case at::kFloat: function(float{}); break;
        case at::kBFloat16: function(c10::BFloat16{}); break;
        case at::kHalf: function(c10::Half{}); break;
        default: TORCH_CHECK(false, "float32, bfloat16 or float16 only");
    }
}

inline floats16 load16(const float* source) {
    floats16 out;
    std::memcpy(&out, source, sizeof(out));
    return out;
}

inline floats16 load16(const c10::BFloat16* source) {
    halfwords16 raw;
    std::memcpy(&raw, source, sizeof(raw));
    return reinterpret_cast<floats16>(__builtin_convertvector(raw, words16) << 16);
}

// (float16 to float32 is exact: the conversion instructions give each lane's own conversion)
inline floats16 load16(const c10::Half* source) {
#if defined(__AVX512F__)
    return (floats16)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(source)));
#elif defined(__AVX__) && defined(__F16C__)
    floats16 out;
    const __m256 low = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(source)));
    const __m256 high = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(source + 8)));
    std::memcpy(&out, &low, sizeof(low));
    std::memcpy(reinterpret_cast<char*>(&out) + sizeof(low), &high, sizeof(high));
    return out;
#else
    floats16 out;
    for (int lane = 0; lane < kLanes; ++lane) out[lane] = static_cast<float>(source[lane]);
    return out;
#endif
}

// The first ``count`` (at most sixteen) lanes stored in ``target``'s dtype, rounded to nearest even: exactly what a
// conversion of each lane alone gives (c10's, NaN included), sixteen lanes at a time for bfloat16.
template <typename scalar_t>
inline void store_lanes(scalar_t* target, floats16 lanes, int64_t count) {
    for (int64_t lane = 0; lane < count; ++lane) target[lane] = static_cast<scalar_t>(lanes[lane]);
}

inline void store_lanes(c10::BFloat16* target, floats16 lanes, int64_t count) {
    // (the machine's own width at a time: GCC lowers the NaN selection of a wider vector to one lane at a time)
    typedef uint32_t native_words __attribute__((vector_size(4 * kNativeLanes)));
    typedef uint16_t native_halfwords __attribute__((vector_size(2 * kNativeLanes)));
    for (int64_t first = 0; first < count; first += kNativeLanes) {
        native_floats part;
        std::memcpy(&part, reinterpret_cast<const float*>(&lanes) + first, sizeof(part));
        const native_words bits = reinterpret_cast<native_words>(part);
        const native_words nearest = (bits + (((bits >> 16) & 1u) + 0x7FFFu)) >> 16;
        const native_words narrowed = part != part ? native_words{} + 0x7FC0u : nearest;
        const native_halfwords halves = __builtin_convertvector(narrowed, native_halfwords);
        std::memcpy(target + first, &halves, std::min<int64_t>(kNativeLanes, count - first) * sizeof(uint16_t));
    }
}

// Sixteen elements from ``source`` where ``count`` (< 16) are there, zeros after them.
template <typename scalar_t>
inline floats16 load_partial(const scalar_t* source, int64_t count) {
    floats16 out = {};
    for (int64_t lane = 0; lane < count; ++lane) out[lane] = static_cast<float>(source[lane]);
    return out;
}

// Chunk ``c`` (sixteen elements) of a head vector of ``dim`` elements; the last one zero-filled when dim is not a
// multiple of sixteen.
template <typename scalar_t>
inline floats16 load_chunk(const scalar_t* vector, int64_t c, int64_t dim) {
    const int64_t left = dim - c * kLanes;
    return left >= kLanes ? load16(vector + c * kLanes) : load_partial(vector + c * kLanes, left);
}

// a * b + c, rounded once where the machine has fused multiply-adds (x86 with AVX-512 or FMA), twice elsewhere (every
// call site rounds alike either way: the build never contracts products and sums by itself).
inline floats16 multiply_add(floats16 a, floats16 b, floats16 c) {
#if defined(__AVX512F__)
    return (floats16)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__)
    typedef float floats8 __attribute__((vector_size(32)));
    const floats8 low = (floats8)_mm256_fmadd_ps(
        (__m256)__builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7), (__m256)__builtin_shufflevector(b, b, 0, 1, 2, 3, 4, 5, 6, 7),
        (__m256)__builtin_shufflevector(c, c, 0, 1, 2, 3, 4, 5, 6, 7));
    const floats8 high = (floats8)_mm256_fmadd_ps(
        (__m256)__builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15),
        (__m256)__builtin_shufflevector(b, b, 8, 9, 10, 11, 12, 13, 14, 15),
        (__m256)__builtin_shufflevector(c, c, 8, 9, 10, 11, 12, 13, 14, 15));
    return __builtin_shufflevector(low, high, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
#else
    return a * b + c;
#endif
}

inline float horizontal_sum(floats16 lanes) {
    // A fixed pairwise pattern: halves, then quarters, and so on.
    typedef float floats8 __attribute__((vector_size(32)));
    typedef float floats4 __attribute__((vector_size(16)));
    floats8 eight = __builtin_shufflevector(lanes, lanes, 0, 1, 2, 3, 4, 5, 6, 7) +
                    __builtin_shufflevector(lanes, lanes, 8, 9, 10, 11, 12, 13, 14, 15);
    floats4 four = __builtin_shufflevector(eight, eight, 0, 1, 2, 3) + __builtin_shufflevector(eight, eight, 4, 5, 6, 7);
    return (four[0] + four[2]) + (four[1] + four[3]);
}

// The horizontal sums of sixteen vectors at once: lane k is bitwise horizontal_sum(lanes[k]) (the same pairwise
// pattern: halves, quarters, then (0 + 2) + (1 + 3)), in 30 shuffles and 15 additions instead of 16 separate sums.
inline floats16 horizontal_sums(const floats16* lanes) {
    floats16 halves[8], quarters[4], pairs[2];
    for (int i = 0; i < 8; ++i) {
        const floats16 a = lanes[2 * i], b = lanes[2 * i + 1];
        halves[i] = __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                    __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    }
    for (int i = 0; i < 4; ++i) {
        const floats16 a = halves[2 * i], b = halves[2 * i + 1];
        quarters[i] = __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
                      __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    }
    for (int i = 0; i < 2; ++i) {
        const floats16 a = quarters[2 * i], b = quarters[2 * i + 1];
        pairs[i] = __builtin_shufflevector(a, b, 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
                   __builtin_shufflevector(a, b, 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    }
    return __builtin_shufflevector(pairs[0], pairs[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
           __builtin_shufflevector(pairs[0], pairs[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

// exp(x) for x <= 0 (scores minus their maximum), a vector at a time (any lane count): range reduction by powers of
// two and a degree-6 polynomial. Every element goes through these same instructions, wherever it sits and whatever
// the vector's width.
template <typename floats, typename ints>
inline floats exp_nonpositive_lanes(floats x) {
    const floats lowest = floats{} - 87.0f;
    x = x < lowest ? lowest : x;
    const floats shifter = floats{} + 12582912.0f;  // 1.5 * 2^23: adding it rounds to the nearest integer
    const floats n = (x * 1.44269504088896341f + shifter) - shifter;
    floats r = x - n * 0.693145751953125f;
    r = r - n * 1.428606765330187045e-06f;
    floats p = r * (1.0f / 720.0f) + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const ints exponent = (__builtin_convertvector(n, ints) + 127) << 23;
    return p * reinterpret_cast<floats>(exponent);
}

inline floats16 exp_nonpositive(floats16 x) { return exp_nonpositive_lanes<floats16, ints16>(x); }

inline native_floats load_native(const float* source) {
    native_floats out;
    std::memcpy(&out, source, sizeof(out));
    return out;
}

inline native_floats load_native(const c10::BFloat16* source) {
    typedef uint16_t halfwords __attribute__((vector_size(2 * kNativeLanes)));
    typedef uint32_t words __attribute__((vector_size(4 * kNativeLanes)));
    halfwords raw;
    std::memcpy(&raw, source, sizeof(raw));
    return reinterpret_cast<native_floats>(__builtin_convertvector(raw, words) << 16);
}

inline native_floats load_native(const c10::Half* source) {
#if defined(__AVX512F__)
    return (native_floats)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(source)));
#elif defined(__AVX__) && defined(__F16C__)
    return (native_floats)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(source)));
#else
    native_floats out;
    for (int lane = 0; lane < kNativeLanes; ++lane) out[lane] = static_cast<float>(source[lane]);
    return out;
#endif
}

// The first ``count`` (at most kNativeLanes) elements at ``source``, zeros after them.
template <typename scalar_t>
inline native_floats load_native_partial(const scalar_t* source, int64_t count) {
    if (count == kNativeLanes) return load_native(source);
    native_floats out = {};
    for (int64_t lane = 0; lane < count; ++lane) out[lane] = static_cast<float>(source[lane]);
    return out;
}

// The first ``count`` lanes stored in ``target``'s dtype: each lane's own conversion (c10's, rounding to nearest
// even), as store_lanes gives.
template <typename scalar_t>
inline void store_native(scalar_t* target, native_floats lanes, int64_t count) {
    for (int64_t lane = 0; lane < count; ++lane) target[lane] = static_cast<scalar_t>(lanes[lane]);
}

inline void store_native(float* target, native_floats lanes, int64_t count) {
    std::memcpy(target, &lanes, count * sizeof(float));
}

// Bit ``lane`` set where lane ``lane`` of the comparison result ``lanes`` is set.
inline uint32_t native_mask(native_ints lanes) {
#if defined(__AVX512DQ__)
    return _mm512_movepi32_mask((__m512i)lanes);
#elif defined(__AVX__) && !defined(__AVX512F__)
    return static_cast<uint32_t>(_mm256_movemask_ps((__m256)lanes));
#else
    uint32_t mask = 0;
    for (int lane = 0; lane < kNativeLanes; ++lane) mask |= (lanes[lane] != 0 ? 1u : 0u) << lane;
    return mask;
#endif
}

}  // namespace draftwise
