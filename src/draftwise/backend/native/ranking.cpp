// Ranking the rows of logits. The k largest logits of each row, best first: the greedy token (k = 1) and the top predictions drafters keep.
// torch's argmax and topk take 27-65 us for one row of a 49k vocabulary on a two-core CPU; a scan that compares
// a vector register's lanes at once with the current k-th best and touches only the lanes above it takes a few.
//
// Ties go to the lower index (torch.argmax's rule; torch.topk leaves their order open). A row holding NaN is not
// ranked here: the call reports it and the caller ranks with torch, which puts NaN above everything.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <tuple>
#include <vector>

#include "vectors.h"

namespace {

using namespace draftwise;

// Most tokens a call ranks per row (callers fall back to torch past it).
constexpr int64_t kMaxTop = 64;
// Rows per thread below which a call stays on one thread.
constexpr int64_t kRankedRowsPerTask = 4;

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
    for (; i + kNativeLanes <= width; i += kNativeLanes) {
        const native_floats lanes = load_native(row + i);
        for (uint32_t mask = native_mask((lanes > best.values[k - 1]) | (lanes != lanes)); mask != 0; mask &= mask - 1) {
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

// ---------------------------------------------------------------------------------------------------------------
// The sampling distribution of every row: temperature, top-k, top-p and min-p (transformers' warpers, in the order
// ``generate`` applies them), then softmax, in a few passes over the row. transformers' top-p sorts the whole
// vocabulary (milliseconds for one row of 49k logits); here the nucleus is found by selection among the tokens that
// can hold its boundary. A row's distribution is computed from that row alone, in an order fixed by the width.

namespace {

// Sums of weights: float lanes within a block of this many elements, each block's lanes added into a double (a
// vector of doubles as wide as the float lanes is twice the register, which GCC would convert lane by lane).
constexpr int64_t kSumBlock = 1024;

// A fixed-order sum of one vector's lanes.
inline double lanes_sum(native_floats lanes) {
    double sum = 0.0;
    for (int lane = 0; lane < kNativeLanes; ++lane) sum += lanes[lane];
    return sum;
}

// A token in rank order: larger value first, equal values by index (the lower first, as greedy decoding breaks ties).
// transformers' top-p keeps tied tokens at its boundary in whatever order its unstable sort leaves them.
struct Candidate {
    float value;
    int64_t index;
};

inline bool ranks_before(const Candidate& a, const Candidate& b) {
    return a.value > b.value || (a.value == b.value && a.index < b.index);
}

// The ``k`` (at most kMaxTop) largest values of ``row``, equal ones by index: a scan that looks one by one only at
// the lanes above the k-th largest so far.
Best largest(const float* row, int64_t width, int64_t k) {
    Best best(k);
    int64_t i = 0;
    for (; i < width && best.count < k; ++i) best.insert(row[i], i);
    for (; i + kNativeLanes <= width; i += kNativeLanes) {
        const native_floats lanes = load_native(row + i);
        for (uint32_t mask = native_mask(lanes > best.values[k - 1]); mask != 0; mask &= mask - 1) {
            const int lane = __builtin_ctz(mask);
            if (best.enters(lanes[lane])) best.insert(lanes[lane], i + lane);
        }
    }
    for (; i < width; ++i)
        if (best.enters(row[i])) best.insert(row[i], i);
    return best;
}

// The k-th largest value of ``row`` (k < width), counting equal values separately, as torch.topk's last value.
float kth_largest(const float* row, int64_t width, int64_t k, std::vector<float>& scratch) {
    if (k <= kMaxTop) return largest(row, width, k).values[k - 1];
    scratch.assign(row, row + width);
    std::nth_element(scratch.begin(), scratch.begin() + (k - 1), scratch.end(), std::greater<float>());
    return scratch[k - 1];
}

// The last token of the nucleus among ``candidates``: the first, in rank order, at which the mass of the tokens
// ranked before it plus its own reaches ``target``. Found by halving with nth_element (linear time), then sorting
// the last few. (Where rounding leaves the whole mass below ``target``, every candidate is kept.)
Candidate nucleus_boundary(std::vector<Candidate>& candidates, double target) {
    size_t low = 0, high = candidates.size();
    double above = 0.0;
    const auto begin = candidates.begin();
    while (high - low > 64) {
        const size_t middle = low + (high - low) / 2;
        std::nth_element(begin + low, begin + middle, begin + high, ranks_before);
        double mass = 0.0;
        for (size_t i = low; i < middle; ++i) mass += candidates[i].value;
        if (above + mass >= target) {
            high = middle;
        } else {
            above += mass;
            low = middle;
        }
    }
    std::sort(begin + low, begin + high, ranks_before);
    for (size_t i = low; i < high; ++i) {
        above += candidates[i].value;
        if (above >= target) return candidates[i];
    }
    return candidates[high - 1];
}

struct SamplingOptions {
    float temperature;
    int64_t top_k;
    double top_p;
    double min_p;
};

// One row's distribution into ``out`` (width floats, also the passes' scratch). Lanes past the last full vector go
// through the same vector instructions, one lane at a time, so every element is computed alike.
template <typename scalar_t>
void sampling_row(const scalar_t* row, int64_t width, const SamplingOptions& options, float* out,
                  std::vector<float>& scratch, std::vector<Candidate>& candidates) {
    const float minus_infinity = -std::numeric_limits<float>::infinity();
    const native_floats zero = {}, never = zero + minus_infinity;
    const int64_t full = width - width % kNativeLanes;
    // Scale, and find the maximum.
    native_floats maximum = never;
    for (int64_t i = 0; i < full; i += kNativeLanes) {
        const native_floats scaled = load_native(row + i) / options.temperature;
        std::memcpy(out + i, &scaled, sizeof(scaled));
        maximum = scaled > maximum ? scaled : maximum;
    }
    float top = minus_infinity;
    for (int lane = 0; lane < kNativeLanes; ++lane) top = std::max(top, maximum[lane]);
    for (int64_t i = full; i < width; ++i) {
        out[i] = static_cast<float>(row[i]) / options.temperature;
        top = std::max(top, out[i]);
    }
    // Top-k: values below the k-th largest leave (equal ones stay, as in transformers).
    const bool top_k = options.top_k > 0 && options.top_k < width;
    const float kth = top_k ? kth_largest(out, width, options.top_k, scratch) : minus_infinity;
    // Weights exp(x - max) of the tokens kept so far (0 for the others and for -inf), and their sum.
    const native_floats kept_from = zero + kth, shift = zero + top;
    const auto weigh = [&](native_floats scaled) {
        const native_floats weight = exp_nonpositive_lanes<native_floats, native_ints>(scaled - shift);
        return (scaled >= kept_from) & (scaled != never) ? weight : zero;
    };
    double mass = 0.0;
    for (int64_t block = 0; block < full; block += kSumBlock) {
        native_floats totals = {};
        for (int64_t i = block; i < std::min(full, block + kSumBlock); i += kNativeLanes) {
            const native_floats weight = weigh(load_native(out + i));
            std::memcpy(out + i, &weight, sizeof(weight));
            totals += weight;
        }
        mass += lanes_sum(totals);
    }
    for (int64_t i = full; i < width; ++i) {
        out[i] = weigh(zero + out[i])[0];
        mass += out[i];
    }
    // Top-p. One pass weighs the mass above a ladder of thresholds (1/4, 1/16, ... of the largest weight, exp(0));
    // the boundary lies among the tokens above the highest threshold whose mass reaches top_p, found by selection
    // among them. Where no threshold of the ladder does, the tokens of weight >= tau are searched: they hold more
    // than top_p of the mass (the others hold at most width * tau = (1 - top_p) / 2 of it).
    const bool nucleus = options.top_p < 1.0;
    Candidate boundary{0.0f, 0};
    if (nucleus) {
        const double target = options.top_p * mass;
        constexpr int kRungs = 10;
        float rungs[kRungs];
        double above[kRungs] = {};
        for (int rung = 0; rung < kRungs; ++rung) rungs[rung] = std::ldexp(1.0f, -2 * (rung + 1));
        for (int64_t block = 0; block < full; block += kSumBlock) {
            native_floats sums[kRungs] = {};
            for (int64_t i = block; i < std::min(full, block + kSumBlock); i += kNativeLanes) {
                const native_floats weight = load_native(out + i);
                for (int rung = 0; rung < kRungs; ++rung) sums[rung] += weight >= rungs[rung] ? weight : zero;
            }
            for (int rung = 0; rung < kRungs; ++rung) above[rung] += lanes_sum(sums[rung]);
        }
        for (int64_t i = full; i < width; ++i)
            for (int rung = 0; rung < kRungs; ++rung) above[rung] += out[i] >= rungs[rung] ? out[i] : 0.0f;
        float tau = static_cast<float>((1.0 - options.top_p) / 2.0 * mass / static_cast<double>(width));
        for (int rung = 0; rung < kRungs; ++rung) {
            if (above[rung] >= target) {
                tau = std::max(tau, rungs[rung]);
                break;
            }
        }
        const native_floats threshold = zero + tau;
        candidates.clear();
        for (int64_t i = 0; i < full; i += kNativeLanes) {
            const native_floats weight = load_native(out + i);
            for (uint32_t mask = native_mask((weight >= threshold) & (weight > zero)); mask != 0; mask &= mask - 1) {
                const int lane = __builtin_ctz(mask);
                candidates.push_back({weight[lane], i + lane});
            }
        }
        for (int64_t i = full; i < width; ++i)
            if (out[i] >= tau && out[i] > 0.0f) candidates.push_back({out[i], i});
        boundary = nucleus_boundary(candidates, target);
    }
    // Min-p: weights below min_p times the largest one (exp(0)) leave.
    const float least = static_cast<float>(options.min_p) * exp_nonpositive_lanes<native_floats, native_ints>(zero)[0];
    const auto kept = [&](float weight, int64_t index) {
        return (!nucleus || ranks_before({weight, index}, boundary) || (weight == boundary.value && index == boundary.index)) &&
               weight >= least;
    };
    if (nucleus) {
        // Every kept token is a candidate: their mass is the kept mass.
        mass = 0.0;
        for (const Candidate& candidate : candidates)
            if (kept(candidate.value, candidate.index)) mass += candidate.value;
    } else if (options.min_p > 0.0) {
        const native_floats floor = zero + least;
        mass = 0.0;
        for (int64_t block = 0; block < full; block += kSumBlock) {
            native_floats totals = {};
            for (int64_t i = block; i < std::min(full, block + kSumBlock); i += kNativeLanes) {
                const native_floats weight = load_native(out + i);
                totals += weight >= floor ? weight : zero;
            }
            mass += lanes_sum(totals);
        }
        for (int64_t i = full; i < width; ++i) mass += out[i] >= least ? out[i] : 0.0f;
    }
    // Normalise the kept weights, zero the others.
    const float scale = static_cast<float>(1.0 / mass);
    const native_floats boundary_value = zero + boundary.value, floor = zero + least;
    native_ints lane_index;
    for (int lane = 0; lane < kNativeLanes; ++lane) lane_index[lane] = lane;
    for (int64_t i = 0; i < full; i += kNativeLanes) {
        const native_floats weight = load_native(out + i);
        // (indices compared relative to the boundary's, which fits 32 bits: rows are far narrower than 2^31)
        const native_ints offset = lane_index + static_cast<int32_t>(i - boundary.index);
        const native_ints in_nucleus =
            nucleus ? (weight > boundary_value) | ((weight == boundary_value) & (offset <= 0)) : native_ints{} - 1;
        const native_floats probability = in_nucleus & (weight >= floor) ? weight * scale : zero;
        std::memcpy(out + i, &probability, sizeof(probability));
    }
    for (int64_t i = full; i < width; ++i) out[i] = kept(out[i], i) ? (zero + out[i])[0] * scale : 0.0f;
}

}  // namespace

// logits: (rows, width) float32, bfloat16 or float16, each row contiguous. Returns the (rows, width) float32
// probabilities of each row after temperature (> 0), top-k (0 = off), top-p (1 = off) and min-p (0 = off).
at::Tensor sampling_probabilities(const at::Tensor& logits, double temperature, int64_t top_k, double top_p,
                                  double min_p) {
    TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1, "logits: (rows, width), each row contiguous");
    TORCH_CHECK(temperature > 0 && top_k >= 0 && top_p > 0 && top_p <= 1 && min_p >= 0 && min_p <= 1,
                "temperature > 0, top_k >= 0, 0 < top_p <= 1, 0 <= min_p <= 1");
    const int64_t rows = logits.size(0), width = logits.size(1);
    TORCH_CHECK(width > 0 && width < (int64_t{1} << 31), "rows of 1 to 2^31 - 1 logits");
    auto output = at::empty({rows, width}, logits.options().dtype(at::kFloat));
    const SamplingOptions options{static_cast<float>(temperature), top_k, top_p, min_p};
    dispatch(logits, [&](auto zero) {
        using scalar_t = decltype(zero);
        const scalar_t* in = logits.data_ptr<scalar_t>();
        float* out = output.data_ptr<float>();
        const int64_t stride = logits.stride(0);
        at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
            std::vector<float> scratch;
            std::vector<Candidate> candidates;
            for (int64_t row = begin; row < end; ++row)
                sampling_row(in + row * stride, width, options, out + row * width, scratch, candidates);
        });
    });
    return output;
}
