// The lean forward's row-wise operations (RMSNorm, rotary embedding with the keys and values rounded to the cache's
// dtype, SiLU gating, the residual addition), one call each for all rows, and the copy of a forward's keys and values
// into a sequence's block cache (one call where two strided torch copies per block cost ~0.1 ms, mostly fixed, of a
// small model's one-row step).
//
// As in the attention kernel, a row's result depends on that row alone: every element goes through the same
// instructions (sums of squares in sixteen lanes over the dimensions, in order, then a fixed pairwise lane sum), so
// plain decoding's lone row and the same row inside a verification forward of any size come out bitwise equal. Each
// call replaces three to eight small torch operations, whose fixed cost per call dominates a one-row forward.
//
// The ``*_into`` forms write the first ``rows`` rows of a given output (contiguous, at least that many rows, its
// other rows left as they are): the compiled layer loop reuses one buffer per intermediate over every layer, where an
// allocation per operation cost more than a small model's row-wise kernels. The allocating forms' ``min_rows``: the
// outputs that feed a linear product get at least that many rows, the extra ones zero, so the product runs at the row
// count the machine's kernel is fastest and invariant at without another copy.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>

#include "kernels.h"
#include "vectors.h"

namespace {

using namespace draftwise;

// Rows per thread below which a call stays on one thread (a thread hand-off costs more than a few rows).
constexpr int64_t kRowsPerTask = 8;

// ``lanes`` rounded to the dtype and back: what a torch operation producing that dtype leaves.
template <typename scalar_t>
inline floats16 rounded(floats16 lanes) {
    scalar_t narrow[kLanes];
    store_lanes(narrow, lanes, kLanes);
    return load16(narrow);
}

template <>
inline floats16 rounded<float>(floats16 lanes) {
    return lanes;
}

template <typename scalar_t>
void rms_norm_row(const scalar_t* row, const scalar_t* weight, int64_t dim, float eps, scalar_t* out) {
    const int64_t chunks = (dim + kLanes - 1) / kLanes;
    floats16 squares = {};
    for (int64_t c = 0; c < chunks; ++c) {
        const floats16 x = load_chunk(row, c, dim);
        squares = squares + x * x;
    }
    const float inverse = 1.0f / std::sqrt(horizontal_sum(squares) / static_cast<float>(dim) + eps);
    for (int64_t c = 0; c < chunks; ++c) {
        // transformers' order: normalised in float32, cast to the model's dtype, then weighted.
        const floats16 normed = rounded<scalar_t>(load_chunk(row, c, dim) * inverse);
        store_lanes(out + c * kLanes, normed * load_chunk(weight, c, dim), std::min<int64_t>(kLanes, dim - c * kLanes));
    }
}

// x * sigmoid(x) lane by lane, through exp of a non-positive argument on both sides of zero; in the machine's own
// vector width, since GCC lowers the comparisons and selections of wider vectors to one lane at a time (sixteen
// lanes on an AVX2 CPU took ~8 us for a SmolLM2 row of 1536, 0.25 ms of a 30-layer step). Each lane's operations are
// the same whatever the width.
inline native_floats silu(native_floats x) {
    const native_floats magnitude = x < 0 ? -x : x;
    const native_floats e = exp_nonpositive_lanes<native_floats, native_ints>(-magnitude);
    const native_floats sigmoid = x < 0 ? e / (1.0f + e) : 1.0f / (1.0f + e);
    return x * sigmoid;
}

template <typename scalar_t>
void silu_mul_row(const scalar_t* gate, const scalar_t* up, int64_t width, scalar_t* out) {
    for (int64_t i = 0; i < width; i += kNativeLanes) {
        const int64_t count = std::min<int64_t>(kNativeLanes, width - i);
        store_native(out + i, silu(load_native_partial(gate + i, count)) * load_native_partial(up + i, count), count);
    }
}

// One head vector rotated: out[i] = x[i] cos[i] + x[(i + half) mod dim] signed_sin[i] (signed_sin's first half
// negated: rotate_half's sign), times ``scale``, in float32, rounded once to ``out``'s dtype (x's, or float16 beside
// float32 rows: what a torch conversion of the float32 result gives).
template <typename scalar_t, typename out_t>
inline void rotate_head(const scalar_t* x, const scalar_t* cos, const scalar_t* signed_sin, int64_t dim, float scale,
                        out_t* out) {
    const int64_t half = dim / 2;
    if (half % kLanes == 0) {
        // Whole chunks: a chunk's partners are the chunk half a vector away (the same operations, lane by lane).
        const int64_t chunks = dim / kLanes, shift = half / kLanes;
        for (int64_t c = 0; c < chunks; ++c) {
            const floats16 partner = load16(x + (c + shift) % chunks * kLanes);
            const floats16 value = load16(x + c * kLanes) * load16(cos + c * kLanes) +
                                   partner * load16(signed_sin + c * kLanes);
            store_lanes(out + c * kLanes, value * scale, kLanes);
        }
        return;
    }
    for (int64_t i = 0; i < dim; ++i) {
        const float partner = static_cast<float>(x[i < half ? i + half : i - half]);
        const float value = static_cast<float>(x[i]) * static_cast<float>(cos[i]) + partner * static_cast<float>(signed_sin[i]);
        out[i] = static_cast<out_t>(value * scale);
    }
}

void check_rows(const at::Tensor& tensor, const char* name) {
    TORCH_CHECK(tensor.dim() == 2 && tensor.stride(1) == 1, name, ": (rows, width), each row contiguous");
}

void check_norm(const at::Tensor& hidden, const at::Tensor& weight) {
    check_rows(hidden, "hidden");
    TORCH_CHECK(weight.dim() == 1 && weight.size(0) == hidden.size(1) && weight.is_contiguous(), "weight: (dim,)");
    TORCH_CHECK(weight.scalar_type() == hidden.scalar_type(), "weight in the hidden states' dtype");
}

// Returns the gated width.
int64_t check_gate_up(const at::Tensor& gate_up, int64_t rows) {
    check_rows(gate_up, "gate_up");
    TORCH_CHECK(rows >= 0 && rows <= gate_up.size(0), "rows: at most gate_up's");
    TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up: an even number of columns");
    return gate_up.size(1) / 2;
}

// Returns the head dimension.
int64_t check_rotation(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& signed_sin, int64_t rows,
                       int64_t heads, int64_t kv_heads) {
    check_rows(qkv, "qkv");
    TORCH_CHECK(cos.is_contiguous() && signed_sin.is_contiguous() && cos.dim() == 2 && cos.sizes() == signed_sin.sizes(),
                "cos, signed_sin: contiguous (rows, dim)");
    const int64_t dim = cos.size(1);
    TORCH_CHECK(rows >= 0 && rows <= qkv.size(0) && cos.size(0) >= rows, "one cos and sin row per row");
    TORCH_CHECK(heads >= 0 && kv_heads >= 0 && dim % 2 == 0 && qkv.size(1) == (heads + 2 * kv_heads) * dim,
                "qkv: (rows, (heads + 2 kv_heads) dim)");
    TORCH_CHECK(cos.scalar_type() == qkv.scalar_type() && signed_sin.scalar_type() == qkv.scalar_type(),
                "cos and sin in qkv's dtype");
    return dim;
}

// A rotation's output: contiguous, at least ``count`` elements, in ``dtype``.
void check_heads_output(const at::Tensor& out, int64_t count, at::ScalarType dtype, const char* name) {
    TORCH_CHECK(out.is_contiguous() && out.numel() >= count && out.scalar_type() == dtype, name,
                ": contiguous, a row's heads after another's, in its dtype");
}

}  // namespace

void check_output_rows(const at::Tensor& out, int64_t rows, int64_t width, at::ScalarType dtype, const char* name) {
    TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.size(0) >= rows && out.size(1) == width &&
                    out.scalar_type() == dtype,
                name, ": contiguous, at least ", rows, " rows of ", width, ", ", dtype);
}

at::Tensor padded_output(int64_t rows, int64_t min_rows, int64_t width, const at::TensorOptions& options) {
    return min_rows > rows ? at::zeros({min_rows, width}, options) : at::empty({rows, width}, options);
}

void rms_norm_into(const at::Tensor& hidden, const at::Tensor& weight, double eps, const at::Tensor& out) {
    check_norm(hidden, weight);
    const int64_t rows = hidden.size(0), dim = hidden.size(1);
    check_output_rows(out, rows, dim, hidden.scalar_type(), "out");
    dispatch(hidden, [&](auto zero) {
        using scalar_t = decltype(zero);
        const scalar_t* in = hidden.data_ptr<scalar_t>();
        const scalar_t* gains = weight.data_ptr<scalar_t>();
        scalar_t* normed = out.data_ptr<scalar_t>();
        const int64_t stride = hidden.stride(0);
        at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
            for (int64_t row = begin; row < end; ++row)
                rms_norm_row(in + row * stride, gains, dim, static_cast<float>(eps), normed + row * dim);
        });
    });
}

// hidden: (rows, dim); weight: (dim,). Returns (max(rows, min_rows), dim), the extra rows zero.
at::Tensor rms_norm(const at::Tensor& hidden, const at::Tensor& weight, double eps, int64_t min_rows) {
    check_norm(hidden, weight);
    auto output = padded_output(hidden.size(0), min_rows, hidden.size(1), hidden.options());
    rms_norm_into(hidden, weight, eps, output);
    return output;
}

void silu_mul_into(const at::Tensor& gate_up, int64_t rows, const at::Tensor& out) {
    const int64_t width = check_gate_up(gate_up, rows);
    check_output_rows(out, rows, width, gate_up.scalar_type(), "out");
    dispatch(gate_up, [&](auto zero) {
        using scalar_t = decltype(zero);
        const scalar_t* in = gate_up.data_ptr<scalar_t>();
        scalar_t* gated = out.data_ptr<scalar_t>();
        const int64_t stride = gate_up.stride(0);
        at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
            for (int64_t row = begin; row < end; ++row)
                silu_mul_row(in + row * stride, in + row * stride + width, width, gated + row * width);
        });
    });
}

// gate_up: (rows, 2 * width), the gate's columns first. Returns silu(gate) * up, (max(rows, min_rows), width).
at::Tensor silu_mul(const at::Tensor& gate_up, int64_t rows, int64_t min_rows) {
    auto output = padded_output(rows, min_rows, check_gate_up(gate_up, rows), gate_up.options());
    silu_mul_into(gate_up, rows, output);
    return output;
}

void rotate_queries_keys_into(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& signed_sin, int64_t rows,
                              int64_t heads, int64_t kv_heads, double scale, const at::Tensor& queries,
                              const at::Tensor& keys, const at::Tensor& values) {
    const int64_t dim = check_rotation(qkv, cos, signed_sin, rows, heads, kv_heads);
    const auto kv_type = keys.scalar_type();
    TORCH_CHECK(kv_type == qkv.scalar_type() || (kv_type == at::kHalf && qkv.scalar_type() == at::kFloat),
                "keys and values in qkv's dtype, or float16 beside float32 rows");
    check_heads_output(queries, rows * heads * dim, qkv.scalar_type(), "queries");
    check_heads_output(keys, rows * kv_heads * dim, kv_type, "keys");
    if (values.defined()) check_heads_output(values, rows * kv_heads * dim, kv_type, "values");
    auto run = [&](auto zero, auto kv_zero) {
        using scalar_t = decltype(zero);
        using kv_t = decltype(kv_zero);
        const scalar_t* in = qkv.data_ptr<scalar_t>();
        const scalar_t* cosines = cos.data_ptr<scalar_t>();
        const scalar_t* sines = signed_sin.data_ptr<scalar_t>();
        scalar_t* query_out = queries.data_ptr<scalar_t>();
        kv_t* key_out = keys.data_ptr<kv_t>();
        kv_t* value_out = values.defined() ? values.data_ptr<kv_t>() : nullptr;
        const int64_t stride = qkv.stride(0), kv_width = kv_heads * dim;
        at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
            for (int64_t row = begin; row < end; ++row) {
                const scalar_t* source = in + row * stride;
                const scalar_t* row_cos = cosines + row * dim;
                const scalar_t* row_sin = sines + row * dim;
                for (int64_t head = 0; head < heads; ++head)
                    rotate_head(source + head * dim, row_cos, row_sin, dim, static_cast<float>(scale),
                                query_out + (row * heads + head) * dim);
                for (int64_t head = 0; head < kv_heads; ++head)
                    rotate_head(source + (heads + head) * dim, row_cos, row_sin, dim, 1.0f,
                                key_out + row * kv_width + head * dim);
                if (value_out != nullptr) {
                    const scalar_t* row_values = source + (heads + kv_heads) * dim;
                    for (int64_t i = 0; i < kv_width; ++i) value_out[row * kv_width + i] = static_cast<kv_t>(row_values[i]);
                }
            }
        });
    };
    if (kv_type == qkv.scalar_type()) dispatch(qkv, [&](auto zero) { run(zero, zero); });
    else run(float{}, c10::Half{});
}

// qkv: (rows, (heads + 2 kv_heads) dim), the rows' fused projections (only the first ``rows`` are read); cos,
// signed_sin: (rows, dim), each row's position's. Returns the rotated queries times ``scale``, (rows, heads, dim),
// and the rotated keys, (rows, kv_heads, dim); the values stay in qkv.
std::tuple<at::Tensor, at::Tensor> rotate_queries_keys(
    const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& signed_sin, int64_t rows, int64_t heads,
    int64_t kv_heads, double scale) {
    const int64_t dim = check_rotation(qkv, cos, signed_sin, rows, heads, kv_heads);
    auto queries = at::empty({rows, heads, dim}, qkv.options());
    auto keys = at::empty({rows, kv_heads, dim}, qkv.options());
    rotate_queries_keys_into(qkv, cos, signed_sin, rows, heads, kv_heads, scale, queries, keys, at::Tensor());
    return {queries, keys};
}

void add_rows_into(const at::Tensor& hidden, const at::Tensor& delta, int64_t rows) {
    check_rows(delta, "delta");
    const int64_t dim = delta.size(1);
    TORCH_CHECK(rows >= 0 && rows <= delta.size(0), "rows: at most delta's");
    check_output_rows(hidden, rows, dim, delta.scalar_type(), "hidden");
    dispatch(delta, [&](auto zero) {
        using scalar_t = decltype(zero);
        scalar_t* sums = hidden.data_ptr<scalar_t>();
        const scalar_t* in = delta.data_ptr<scalar_t>();
        const int64_t stride = delta.stride(0);
        at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
            for (int64_t row = begin; row < end; ++row)
                for (int64_t i = 0; i < dim; i += kLanes) {
                    const int64_t count = std::min<int64_t>(kLanes, dim - i);
                    scalar_t* sum = sums + row * dim + i;
                    const scalar_t* term = in + row * stride + i;
                    store_lanes(sum, count == kLanes ? load16(sum) + load16(term)
                                                     : load_partial(sum, count) + load_partial(term, count),
                                count);
                }
        });
    });
}

void write_rows(const at::Tensor& key_cache, const at::Tensor& value_cache, const at::Tensor& keys,
                const at::Tensor& values, int64_t slot, int64_t first, int64_t count) {
    TORCH_CHECK(key_cache.dim() == 5 && value_cache.sizes() == key_cache.sizes(),
                "caches: (layers, blocks, kv_heads, block, head_dim) each");
    TORCH_CHECK(keys.dim() == 4 && values.sizes() == keys.sizes(), "rows: (layers, rows, kv_heads, head_dim) each");
    const int64_t layers = key_cache.size(0), blocks = key_cache.size(1), kv_heads = key_cache.size(2);
    const int64_t block = key_cache.size(3), dim = key_cache.size(4), rows = keys.size(1);
    TORCH_CHECK(keys.size(0) == layers && keys.size(2) == kv_heads && keys.size(3) == dim, "rows and caches disagree");
    TORCH_CHECK(first >= 0 && count >= 0 && first + count <= rows, "rows first .. first + count - 1 out of range");
    TORCH_CHECK(slot >= 0 && slot + count <= blocks * block, "positions past the cache");
    for (const at::Tensor* tensor : {&key_cache, &value_cache, &keys, &values}) {
        TORCH_CHECK(tensor->device().is_cpu() && tensor->is_contiguous(), "contiguous CPU tensors");
        TORCH_CHECK(tensor->scalar_type() == key_cache.scalar_type(), "one dtype for rows and caches");
    }
    const int64_t bytes = dim * static_cast<int64_t>(key_cache.element_size());
    const std::pair<const at::Tensor*, const at::Tensor*> pairs[] = {{&key_cache, &keys}, {&value_cache, &values}};
    for (const auto& [cache, source] : pairs) {
        char* out = static_cast<char*>(cache->data_ptr());
        const char* in = static_cast<const char*>(source->data_ptr());
        for (int64_t layer = 0; layer < layers; ++layer)
            for (int64_t row = 0; row < count; ++row) {
                const int64_t position = slot + row;
                const int64_t target_block = position / block, offset = position % block;
                for (int64_t head = 0; head < kv_heads; ++head)
                    std::memcpy(out + (((layer * blocks + target_block) * kv_heads + head) * block + offset) * bytes,
                                in + ((layer * rows + first + row) * kv_heads + head) * bytes,
                                static_cast<size_t>(bytes));
            }
    }
}
