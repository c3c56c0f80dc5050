// The k largest logits of each row, best first: the greedy token (k = 1) and the top predictions drafters keep.
// torch's argmax and topk take 27-65 us for one row of a 49k vocabulary on a two-core CPU; a scan that compares
// sixteen lanes at once with the current k-th best and touches only the lanes above it takes a few.
//
// Ties go to the lower index (torch.argmax's rule; torch.topk leaves their order open). A row holding NaN is not
// ranked here: the call reports it and the caller ranks with torch, which puts NaN above everything.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <tuple>

#include "vectors.h"

namespace {

using namespace draftwise;

// Most tokens a call ranks per row (callers fall back to torch past it).
constexpr int64_t kMaxTop = 64;
// Rows per thread below which a call stays on one thread.
constexpr int64_t kRankedRowsPerTask = 4;

// Bit ``lane`` set where lane ``lane`` of ``lanes`` is non-zero.
inline uint32_t lane_mask(ints16 lanes) {
#if defined(__AVX512DQ__)
    return _mm512_movepi32_mask((__m512i)lanes);
#elif defined(__AVX__)
    typedef int32_t ints8 __attribute__((vector_size(32)));
    const ints8 low = __builtin_shufflevector(lanes, lanes, 0, 1, 2, 3, 4, 5, 6, 7);
    const ints8 high = __builtin_shufflevector(lanes, lanes, 8, 9, 10, 11, 12, 13, 14, 15);
    return static_cast<uint32_t>(_mm256_movemask_ps((__m256)low)) |
           (static_cast<uint32_t>(_mm256_movemask_ps((__m256)high)) << 8);
#else
    uint32_t mask = 0;
    for (int lane = 0; lane < kLanes; ++lane) mask |= (lanes[lane] != 0 ? 1u : 0u) << lane;
    return mask;
#endif
}

// The best ``k`` of a row so far, in descending order (equal values in index order).
struct Best {
    float values[kMaxTop];
    int64_t indices[kMaxTop];
    int64_t count = 0;
    int64_t k;

    explicit Best(int64_t k) : k(k) {}

    // Whether ``value`` enters (it must beat the current last once k are held: an equal one comes later).
    bool enters(float value) const { return count < k || value > values[k - 1]; }

    void insert(float value, int64_t index) {
        int64_t at = count < k ? count++ : k - 1;  // a new slot, or the last one's (dropped)
        for (; at > 0 && value > values[at - 1]; --at) {
            values[at] = values[at - 1];
            indices[at] = indices[at - 1];
        }
        values[at] = value;
        indices[at] = index;
    }
};

// Ranks one row into ``out`` (k indices); false where the row holds NaN.
template <typename scalar_t>
bool rank_row(const scalar_t* row, int64_t width, int64_t k, int64_t* out) {
    Best best(k);
    const auto consider = [&](float value, int64_t index) {
        if (std::isnan(value)) return false;
        if (best.enters(value)) best.insert(value, index);
        return true;
    };
    int64_t i = 0;
    for (; i < width && best.count < k; ++i)
        if (!consider(static_cast<float>(row[i]), i)) return false;
    // Once k are held, only lanes above the k-th best (or NaN) are looked at one by one.
    for (; i + kLanes <= width; i += kLanes) {
        const floats16 lanes = load16(row + i);
        for (uint32_t mask = lane_mask((lanes > best.values[k - 1]) | (lanes != lanes)); mask != 0; mask &= mask - 1) {
            const int lane = __builtin_ctz(mask);
            if (!consider(lanes[lane], i + lane)) return false;
        }
    }
    for (; i < width; ++i)
        if (!consider(static_cast<float>(row[i]), i)) return false;
    for (int64_t j = 0; j < k; ++j) out[j] = best.indices[j];
    return true;
}

}  // namespace

// logits: (rows, width) float32, bfloat16 or float16, each row contiguous; 1 <= k <= min(width, 64). Returns the
// (rows, k) int64 indices of each row's k largest values, best first, and whether every row was free of NaN (where
// not, the indices are not to be used).
std::tuple<at::Tensor, bool> top_tokens(const at::Tensor& logits, int64_t k) {
    TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1, "logits: (rows, width), each row contiguous");
    const int64_t rows = logits.size(0), width = logits.size(1);
    TORCH_CHECK(k >= 1 && k <= width && k <= kMaxTop, "k: 1 to min(width, ", kMaxTop, ")");
    auto output = at::empty({rows, k}, logits.options().dtype(at::kLong));
    std::atomic<bool> ranked{true};
    dispatch(logits, [&](auto zero) {
        using scalar_t = decltype(zero);
        const scalar_t* in = logits.data_ptr<scalar_t>();
        int64_t* out = output.data_ptr<int64_t>();
        const int64_t stride = logits.stride(0);
        at::parallel_for(0, rows, kRankedRowsPerTask, [&](int64_t begin, int64_t end) {
            for (int64_t row = begin; row < end; ++row)
                if (!rank_row(in + row * stride, width, k, out + row * k)) ranked = false;
        });
    });
    return {output, ranked.load()};
}
