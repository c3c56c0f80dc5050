// Sixteen-lane float arithmetic shared by the kernels: loads from every supported dtype, a fixed-order horizontal
// sum and a vector exponential. Every element goes through the same instructions wherever it sits, which is what
// makes the kernels' results independent of how many rows a call holds.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <cstring>

namespace draftwise {

// Sixteen floats: one AVX-512 register, two AVX2 ones; GCC's vector extensions keep the arithmetic the same on both.
typedef float floats16 __attribute__((vector_size(64)));
typedef int32_t ints16 __attribute__((vector_size(64)));
typedef uint32_t words16 __attribute__((vector_size(64)));
typedef uint16_t halfwords16 __attribute__((vector_size(32)));
constexpr int kLanes = 16;

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

inline floats16 load16(const c10::Half* source) {
    floats16 out;
    for (int lane = 0; lane < kLanes; ++lane) out[lane] = static_cast<float>(source[lane]);
    return out;
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

inline float horizontal_sum(floats16 lanes) {
    // A fixed pairwise pattern: halves, then quarters, and so on.
    typedef float floats8 __attribute__((vector_size(32)));
    typedef float floats4 __attribute__((vector_size(16)));
    floats8 eight = __builtin_shufflevector(lanes, lanes, 0, 1, 2, 3, 4, 5, 6, 7) +
                    __builtin_shufflevector(lanes, lanes, 8, 9, 10, 11, 12, 13, 14, 15);
    floats4 four = __builtin_shufflevector(eight, eight, 0, 1, 2, 3) + __builtin_shufflevector(eight, eight, 4, 5, 6, 7);
    return (four[0] + four[2]) + (four[1] + four[3]);
}

// exp(x) for x <= 0 (scores minus their maximum), sixteen at a time: range reduction by powers of two and a
// degree-6 polynomial. Every element goes through these same vector instructions, wherever it sits.
inline floats16 exp_nonpositive(floats16 x) {
    const floats16 lowest = floats16{} - 87.0f;
    x = x < lowest ? lowest : x;
    const floats16 shifter = floats16{} + 12582912.0f;  // 1.5 * 2^23: adding it rounds to the nearest integer
    const floats16 n = (x * 1.44269504088896341f + shifter) - shifter;
    floats16 r = x - n * 0.693145751953125f;
    r = r - n * 1.428606765330187045e-06f;
    floats16 p = r * (1.0f / 720.0f) + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const ints16 exponent = (__builtin_convertvector(n, ints16) + 127) << 23;
    return p * reinterpret_cast<floats16>(exponent);
}

}  // namespace draftwise
