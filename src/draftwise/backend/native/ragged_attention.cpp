// Attention of ragged verification rows over per-sequence block caches, in one call per layer.
//
// Every row's result is a function of its own query, keys and values alone, computed in an order fixed by its
// position: the same instructions run for a row whether it is plain decoding's lone row, a node of a draft tree or
// one row of a batch, so verification rows are bitwise plain decoding's by construction. Scores are computed key by
// key (sixteen lanes of multiply-adds over the head dimensions, in dimension order, or for bfloat16 on CPUs with
// avx512_bf16 pairs of dimensions multiplied and added by vdpbf16ps straight from the cache; then the lanes in a
// fixed pairwise pattern, for sixteen keys at once with the same pattern: committed keys, and this forward's where it
// has sixteen or more, as a prefill has), except for bfloat16 heads of
// 64 or 128 dimensions there: sixteen keys transposed into one register per dimension pair, each score four
// partial sums in lanes (see transpose_words), no horizontal sums; the weighted values position
// by position (for bfloat16 with avx512_bf16, position pair by position pair, weights rounded to bfloat16, by
// vdpbf16ps: see attend_value_pairs), and the weights' total in sixteen interleaved partial sums added in a fixed
// pattern; rows are split between threads whole, so the thread count changes nothing either.
//
// A row reads its sequence's committed positions in place from the block-major cache ``(layers, blocks, kv_heads,
// block, head_dim)`` and this forward's rows on its path (its ancestors, then itself) from the new keys and values.
// Keys and values are in the query's dtype, or in float16 beside float32 queries (half the bytes a row reads per
// position): widened exactly to float32 as they are loaded, so the arithmetic is the float32 kernel's on their values.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "kernels.h"
#include "vectors.h"

namespace {

using namespace draftwise;

// The inner loops' helpers, inlined whatever the compiler's size budget: one called from two places grew past it
// once (score_keys out of line made a one-row decode's attention 1.5x slower).
#define DRAFTWISE_INLINE inline __attribute__((always_inline))

struct Scratch {
    std::vector<floats16> queries;  // (rows, group, chunks)
    std::vector<floats16> sums;     // (rows, group, chunks)
    std::vector<float> scores;      // (rows, group, padded positions)
    std::vector<float> totals;      // (rows, group)
    std::vector<uint32_t> weight_pairs;  // (rows, group, padded / 2): bfloat16 weights of position pairs
    std::vector<float> fresh_scores;     // (rows, group, padded fresh rows): scores against this forward's keys
    std::vector<int64_t> path_spans;     // (rows, 2): the lowest and highest of this forward's rows on a row's path
    std::vector<const c10::BFloat16*> query_heads;  // (rows, group): each query head's vector
};

constexpr int64_t kMaxChunks = 16;  // head_dim up to 256
// Chunks a tile of sixteen keys keeps per key: C where the head's is known when compiling (a tile of 64-dimension
// keys then takes 4 KB of the stack, in one run, rather than 16 KB with a key every kilobyte).
template <int C>
constexpr int kKeyStride = C > 0 ? C : kMaxChunks;
// Positions per block of the caches (draftwise.backend.forward.lean.BLOCK), known when compiling: a division by a variable
// for every key and value, in the innermost loops, cost 6-11% of the kernel's time (and a variable shift more).
constexpr int64_t kCacheBlock = 64;
// Positions ahead whose cached keys and values are prefetched: a sequence's cache is read in runs of one block
// (a few pages, past which the hardware's prefetchers stop), and without the hint a layer's attention waits on memory
// two to three times as long as it computes. One block ahead (64 positions, 8 KB of bfloat16 keys at head_dim 64)
// measured best with the weights streaming between layers (cold caches): against 32, 8% less for one row at 500
// positions, 13% at 1500, 7% for eight sequences' rows at 500; 96 and 128 were slower again, as was an L2 hint.
constexpr int64_t kPrefetchAhead = 64;
// The smallest cap on a run's rows in the split by size (see ragged_attention): a sequence of this many rows or
// fewer stays whole there, since each run reads its committed keys again.
constexpr int64_t kSmallestRunCap = 16;

// Where one sequence's rows find their keys and values: the committed ones in the block cache of one layer and key
// head, this forward's in the new rows.
template <typename scalar_t>
struct SequenceView {
    const scalar_t* keys;  // the cache at (layer, block 0, head, offset 0)
    const scalar_t* values;
    int64_t block_stride, committed;
    const scalar_t* fresh_keys;  // this forward's rows at head ``head``: row ``i`` at ``i * fresh_stride``
    const scalar_t* fresh_values;
    int64_t fresh_key_stride, fresh_value_stride;

    // The committed key and value at ``position`` (head vectors of ``dim`` elements).
    const scalar_t* key(int64_t position, int64_t dim) const { return cached(keys, position, dim); }
    const scalar_t* value(int64_t position, int64_t dim) const { return cached(values, position, dim); }
    const scalar_t* cached(const scalar_t* base, int64_t position, int64_t dim) const {
        const auto at = static_cast<uint64_t>(position);  // (never negative: unsigned division is a shift)
        return base + static_cast<int64_t>(at / kCacheBlock) * block_stride + static_cast<int64_t>(at % kCacheBlock) * dim;
    }
};

// Asks for one cached head vector (``dim`` elements) ahead of its use, into every level of cache (for reading,
// high locality: prefetcht0 on x86, as _mm_prefetch(..., _MM_HINT_T0) gives; the machine's own hint elsewhere).
template <typename scalar_t>
inline void prefetch(const scalar_t* vector, int64_t dim) {
    const char* bytes = reinterpret_cast<const char*>(vector);
    for (int64_t offset = 0; offset < dim * static_cast<int64_t>(sizeof(scalar_t)); offset += 64)
        __builtin_prefetch(bytes + offset, 0, 3);
}

// The committed value kPrefetchAhead positions past ``position`` (if it exists), ahead of its use.
template <typename scalar_t>
inline void prefetch_value(const SequenceView<scalar_t>& view, int64_t position, int64_t dim) {
    if (const int64_t ahead = position + kPrefetchAhead; ahead < view.committed) prefetch(view.value(ahead, dim), dim);
}

template <typename scalar_t>
DRAFTWISE_INLINE void load_vector(const scalar_t* source, int64_t chunks, int64_t dim, floats16* out) {
    for (int64_t c = 0; c < chunks; ++c) out[c] = load_chunk(source, c, dim);
}

// A query's products with a key, sixteen lanes of dimensions multiplied and added in dimension order: the lanes
// whose fixed pairwise sum (horizontal_sum, or horizontal_sums for sixteen keys at once) is the score. The same
// arithmetic for every (row, key).
DRAFTWISE_INLINE floats16 score_lanes(const floats16* query, const floats16* key, int64_t chunks) {
    floats16 total = {};
    for (int64_t c = 0; c < chunks; ++c) total = multiply_add(query[c], key[c], total);
    return total;
}

#if defined(__AVX512BF16__)
constexpr bool kPairedBf16 = true;
// A bfloat16 query's products with a bfloat16 key read in place: pairs of dimensions multiplied and added into
// sixteen lanes (vdpbf16ps; a product of two bfloat16 values is exact in float32), in dimension order. Every key of
// a bfloat16 model goes through it, committed or fresh, so a key's score is the same wherever it sits.
inline floats16 score_lanes(const c10::BFloat16* query, const c10::BFloat16* key, int64_t dim) {
    __m512 total = _mm512_setzero_ps();
    int64_t d = 0;
    for (; d + 32 <= dim; d += 32)
        total = _mm512_dpbf16_ps(total, (__m512bh)_mm512_loadu_si512(query + d), (__m512bh)_mm512_loadu_si512(key + d));
    if (d < dim) {
        const __mmask32 mask = static_cast<__mmask32>((1ull << (dim - d)) - 1);
        total = _mm512_dpbf16_ps(total, (__m512bh)_mm512_maskz_loadu_epi16(mask, query + d),
                                 (__m512bh)_mm512_maskz_loadu_epi16(mask, key + d));
    }
    return (floats16)total;
}
#else
constexpr bool kPairedBf16 = false;
#endif

// The scores of one row's ``G`` query heads against one key (this forward's rows on its path).
template <int G>
DRAFTWISE_INLINE void score_key(const floats16* queries, const floats16* key, int64_t chunks, float* scores,
                                int64_t padded, int64_t position) {
    for (int g = 0; g < G; ++g) scores[g * padded + position] = horizontal_sum(score_lanes(queries + g * chunks, key, chunks));
}

// The scores of ``rows`` rows' ``G`` query heads against ``count`` (at most sixteen) consecutive committed keys from
// ``position``; ``keys`` holds sixteen (those past ``count`` are ignored).
template <int G, int Stride>
DRAFTWISE_INLINE void score_keys(const floats16* queries, const floats16 (*keys)[Stride], int64_t count,
                                 int64_t rows, int64_t chunks, float* scores, int64_t padded, int64_t position) {
    floats16 lanes[kLanes];
    for (int64_t r = 0; r < rows; ++r)
        for (int g = 0; g < G; ++g) {
            const floats16* q = queries + (r * G + g) * chunks;
            for (int k = 0; k < kLanes; ++k) lanes[k] = score_lanes(q, keys[k], chunks);
            const floats16 sums = horizontal_sums(lanes);
            std::memcpy(scores + (r * G + g) * padded + position, &sums, count * sizeof(float));
        }
}

#if defined(__AVX512BF16__)
// Scores of bfloat16 heads of 64 or 128 dimensions, sixteen keys per register: the keys' dimension pairs are
// transposed (word d of every key in one vector) so that one vdpbf16ps with a query's pair d broadcast adds pair d's
// products to sixteen keys' scores at once, with no horizontal sums. A score is four float32 partial sums (pairs d
// = 0, 4, 8, ... into the first, 1, 5, 9, ... into the second, and so on), each taken by vdpbf16ps in pair order,
// then (s0 + s1) + (s2 + s3): each lane's arithmetic depends on its query and key alone (a product of two bfloat16
// values is exact in float32, so which operand holds the query changes nothing), so a score has the same bits
// wherever its key sits, committed or this forward's, and whatever is computed beside it. Four sums per score keep
// sixteen multiply-adds in flight for the three query heads of one row.

// The 16 x 16 transpose of 32-bit words: word k of row r goes to word r of row k.
inline void transpose_words(__m512i* rows) {
    __m512i a[16];
    for (int i = 0; i < 8; ++i) {
        a[2 * i] = _mm512_unpacklo_epi32(rows[2 * i], rows[2 * i + 1]);
        a[2 * i + 1] = _mm512_unpackhi_epi32(rows[2 * i], rows[2 * i + 1]);
    }
    // b[4i + e], 128-bit lane L: words 4L + e of rows 4i .. 4i + 3.
    __m512i b[16];
    for (int i = 0; i < 4; ++i) {
        b[4 * i] = _mm512_unpacklo_epi64(a[4 * i], a[4 * i + 2]);
        b[4 * i + 1] = _mm512_unpackhi_epi64(a[4 * i], a[4 * i + 2]);
        b[4 * i + 2] = _mm512_unpacklo_epi64(a[4 * i + 1], a[4 * i + 3]);
        b[4 * i + 3] = _mm512_unpackhi_epi64(a[4 * i + 1], a[4 * i + 3]);
    }
    for (int e = 0; e < 4; ++e) {
        const __m512i low = _mm512_shuffle_i32x4(b[e], b[4 + e], 0x44), high = _mm512_shuffle_i32x4(b[e], b[4 + e], 0xEE);
        const __m512i low2 = _mm512_shuffle_i32x4(b[8 + e], b[12 + e], 0x44);
        const __m512i high2 = _mm512_shuffle_i32x4(b[8 + e], b[12 + e], 0xEE);
        rows[e] = _mm512_shuffle_i32x4(low, low2, 0x88);
        rows[4 + e] = _mm512_shuffle_i32x4(low, low2, 0xDD);
        rows[8 + e] = _mm512_shuffle_i32x4(high, high2, 0x88);
        rows[12 + e] = _mm512_shuffle_i32x4(high, high2, 0xDD);
    }
}

// Sixteen keys' P dimension pairs, transposed: ``out[d]`` holds key k's pair d in word k.
template <int P>
inline void transpose_keys(const c10::BFloat16* const* keys, __m512i* out) {
    for (int h = 0; h < P / 16; ++h) {
        __m512i rows[16];
        for (int k = 0; k < 16; ++k) rows[k] = _mm512_loadu_si512(keys[k] + 32 * h);
        transpose_words(rows);
        for (int d = 0; d < 16; ++d) out[16 * h + d] = rows[d];
    }
}

inline int32_t word_at(const c10::BFloat16* vector, int64_t pair) {
    int32_t word;
    std::memcpy(&word, vector + 2 * pair, sizeof(word));
    return word;
}

// The scores of Q queries (P dimension pairs each) against sixteen transposed keys, one register each.
template <int P, int Q>
inline void score_transposed(const c10::BFloat16* const* queries, const __m512i* keys, __m512* out) {
    __m512 sums[Q][4];
    for (int q = 0; q < Q; ++q)
        for (int j = 0; j < 4; ++j) sums[q][j] = _mm512_setzero_ps();
    for (int d = 0; d < P; d += 4)
        for (int j = 0; j < 4; ++j) {
            const __m512bh key = (__m512bh)keys[d + j];
            for (int q = 0; q < Q; ++q)
                sums[q][j] = _mm512_dpbf16_ps(sums[q][j], (__m512bh)_mm512_set1_epi32(word_at(queries[q], d + j)), key);
        }
    for (int q = 0; q < Q; ++q)
        out[q] = _mm512_add_ps(_mm512_add_ps(sums[q][0], sums[q][1]), _mm512_add_ps(sums[q][2], sums[q][3]));
}

// The scores of ``count`` queries against sixteen transposed keys, the first ``keys`` of them stored at
// ``scores + query * stride``.
template <int P>
inline void score_queries(const c10::BFloat16* const* queries, int64_t count, const __m512i* tile, float* scores,
                          int64_t stride, int64_t keys) {
    __m512 out[4];
    for (int64_t first = 0; first < count; first += 4) {
        const int64_t group = std::min<int64_t>(4, count - first);
        switch (group) {
            case 1: score_transposed<P, 1>(queries + first, tile, out); break;
            case 2: score_transposed<P, 2>(queries + first, tile, out); break;
            case 3: score_transposed<P, 3>(queries + first, tile, out); break;
            default: score_transposed<P, 4>(queries + first, tile, out); break;
        }
        for (int64_t q = 0; q < group; ++q) std::memcpy(scores + (first + q) * stride, &out[q], keys * sizeof(float));
    }
}
#endif

// Adds one value, weighted by each row's and query head's weight at ``position``, to their sums.
template <int G>
inline void add_value(const float* weights, const floats16* value, int64_t rows, int64_t chunks, floats16* sums,
                      int64_t padded, int64_t position) {
    for (int64_t r = 0; r < rows; ++r)
        for (int g = 0; g < G; ++g) {
            const float weight = weights[(r * G + g) * padded + position];
            floats16* sum = sums + (r * G + g) * chunks;
            const floats16 broadcast = floats16{} + weight;
            for (int64_t c = 0; c < chunks; ++c) sum[c] = multiply_add(broadcast, value[c], sum[c]);
        }
}

// Adds the committed values, weighted, to the sums of ``T`` rows (from ``first``) and their ``G`` query heads: the
// same multiply-adds in the same position order as add_value, with the sums held in registers and each value
// converted once for the ``T`` rows.
template <typename scalar_t, int G, int C, int T>
inline void add_committed_values(const SequenceView<scalar_t>& view, const float* weights, int64_t first, int64_t dim,
                                 floats16* sums, int64_t padded) {
    floats16 totals[T][G][C];
    for (int t = 0; t < T; ++t)
        for (int g = 0; g < G; ++g)
            for (int c = 0; c < C; ++c) totals[t][g][c] = sums[((first + t) * G + g) * C + c];
    floats16 value[C];
    for (int64_t p = 0; p < view.committed; ++p) {
        prefetch_value(view, p, dim);
        load_vector(view.value(p, dim), C, dim, value);
        for (int t = 0; t < T; ++t)
            for (int g = 0; g < G; ++g) {
                const floats16 broadcast = floats16{} + weights[((first + t) * G + g) * padded + p];
                for (int c = 0; c < C; ++c) totals[t][g][c] = multiply_add(broadcast, value[c], totals[t][g][c]);
            }
    }
    for (int t = 0; t < T; ++t)
        for (int g = 0; g < G; ++g)
            for (int c = 0; c < C; ++c) sums[((first + t) * G + g) * C + c] = totals[t][g][c];
}

// Each row's lowest and highest position among this forward's rows on its path (``spans``, two per row; a row
// without any: an empty span), returned as the lowest and highest over all rows (highest -1: no row has any).
inline std::pair<int64_t, int64_t> path_spans(int64_t rows, const int64_t* const* paths, const int64_t* path_lengths,
                                              std::vector<int64_t>& spans) {
    spans.resize(2 * rows);
    int64_t lowest = std::numeric_limits<int64_t>::max(), highest = -1;
    for (int64_t r = 0; r < rows; ++r) {
        int64_t low = std::numeric_limits<int64_t>::max(), high = -1;
        for (int64_t j = 0; j < path_lengths[r]; ++j) {
            low = std::min(low, paths[r][j]);
            high = std::max(high, paths[r][j]);
        }
        spans[2 * r] = low;
        spans[2 * r + 1] = high;
        lowest = std::min(lowest, low);
        highest = std::max(highest, high);
    }
    return {lowest, highest};
}

// Whether a row's span (see path_spans) meets the sixteen positions from ``start``.
inline bool span_meets(const int64_t* span, int64_t start) { return span[1] >= start && span[0] < start + kLanes; }

// Whether a path is a run of consecutive positions (a chain's, a prefill's).
inline bool is_run(const int64_t* path, int64_t length) {
    for (int64_t j = 1; j < length; ++j)
        if (path[j] != path[0] + j) return false;
    return true;
}

// Each row's scores against this forward's keys on its path, picked out of ``fresh`` (row r, head g at ``(r * G + g)
// * fresh_padded``, position p at p - lowest) into ``scores`` after the committed positions; a run's as one copy.
template <int G>
void pick_path_scores(int64_t rows, const int64_t* const* paths, const int64_t* path_lengths, const float* fresh,
                      int64_t fresh_padded, int64_t lowest, float* scores, int64_t padded, int64_t committed) {
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t length = path_lengths[r];
        if (length == 0) continue;
        const bool run = is_run(paths[r], length);
        for (int g = 0; g < G; ++g) {
            const float* from = fresh + (r * G + g) * fresh_padded - lowest;
            float* to = scores + (r * G + g) * padded + committed;
            if (run) std::memcpy(to, from + paths[r][0], length * sizeof(float));
            else for (int64_t j = 0; j < length; ++j) to[j] = from[paths[r][j]];
        }
    }
}

// The scores of every row's ``G`` query heads against this forward's keys on its path, into ``scores`` after the
// committed positions, each with the bits score_key gives it. A forward with sixteen or more of them (a prefill's
// rows share their keys) takes them sixteen at a time from the lowest position on any path, each tile loaded once
// for all the rows and scored as committed keys are (horizontal_sums: each lane bitwise horizontal_sum of its key's
// lanes) for the rows whose span meets it, the keys past the last whole tile one at a time, each path's scores in
// place or picked out of a buffer (see below). Fewer (a decoding row, a draft's chain or tree) are scored one by one
// along each path.
template <typename scalar_t, int G, int C>
__attribute__((noinline)) void score_fresh_keys(const SequenceView<scalar_t>& view, const floats16* query_vectors,
                                                int64_t rows, const int64_t* const* paths, const int64_t* path_lengths,
                                                int64_t chunks, int64_t dim, float* scores, int64_t padded,
                                                Scratch& scratch) {
    const int64_t committed = view.committed;
    const auto [lowest, highest] = path_spans(rows, paths, path_lengths, scratch.path_spans);
    if (highest < 0) return;
    const int64_t tiled_end = lowest + (highest + 1 - lowest) / kLanes * kLanes;  // (past the whole tiles)
    floats16 key[kMaxChunks];
    if (tiled_end == lowest) {
        for (int64_t r = 0; r < rows; ++r)
            for (int64_t j = 0; j < path_lengths[r]; ++j) {
                load_vector(view.fresh_keys + paths[r][j] * view.fresh_key_stride, chunks, dim, key);
                score_key<G>(query_vectors + r * G * chunks, key, chunks, scores + r * G * padded, padded,
                             committed + j);
            }
        return;
    }
    // Whether every path is a run of positions from the lowest (a prefill's, a chain's): then a key's score goes
    // straight to its place in each row's scores (a whole tile's past a row's own keys lands in the padding after
    // them, which the softmax overwrites), else to a buffer each path's scores are picked from.
    const int64_t* spans = scratch.path_spans.data();
    bool direct = true;
    for (int64_t r = 0; r < rows && direct; ++r)
        direct = path_lengths[r] == 0 || (paths[r][0] == lowest && is_run(paths[r], path_lengths[r]));
    const int64_t fresh_padded = (highest - lowest + kLanes) / kLanes * kLanes;
    if (!direct) scratch.fresh_scores.resize(rows * G * fresh_padded);
    float* target = direct ? scores + committed : scratch.fresh_scores.data();
    const int64_t stride = direct ? padded : fresh_padded;
    floats16 keys[kLanes][kKeyStride<C>];
    for (int64_t start = lowest; start < tiled_end; start += kLanes) {
        for (int64_t k = 0; k < kLanes; ++k)
            load_vector(view.fresh_keys + (start + k) * view.fresh_key_stride, chunks, dim, keys[k]);
        for (int64_t r = 0; r < rows; ++r)
            if (span_meets(spans + 2 * r, start))
                score_keys<G>(query_vectors + r * G * chunks, keys, kLanes, 1, chunks, target + r * G * stride, stride,
                              start - lowest);
    }
    for (int64_t p = tiled_end; p <= highest; ++p) {
        load_vector(view.fresh_keys + p * view.fresh_key_stride, chunks, dim, key);
        for (int64_t r = 0; r < rows; ++r)
            if (spans[2 * r] <= p && p <= spans[2 * r + 1])
                score_key<G>(query_vectors + r * G * chunks, key, chunks, target + r * G * stride, stride,
                             p - lowest);
    }
    if (!direct) pick_path_scores<G>(rows, paths, path_lengths, target, stride, lowest, scores, padded, committed);
}

// Query heads whose sums, with a value, fit the 32 vector registers: the largest divisor of G that does (0: none).
constexpr int heads_per_pass(int G, int C) {
    for (int heads = G; heads >= 1; --heads)
        if (G % heads == 0 && C > 0 && (heads + 1) * C <= 32) return heads;
    return 0;
}

// Adds the values of this forward's rows on row ``r``'s path, weighted, to its sums: add_value's multiply-adds in
// the same order (path order) for each query head, the sums of H heads at a time held in registers (each head's
// sums are its own: taking heads in passes changes no sum's order). (Out of line, as score_fresh_keys: inlined, they
// slowed the caller's one-row attention by 6-8 %.)
template <typename scalar_t, int G, int C, int H>
__attribute__((noinline)) void add_path_values(const SequenceView<scalar_t>& view, const float* weights, int64_t r,
                                               const int64_t* path, int64_t length, int64_t dim, floats16* sums,
                                               int64_t padded) {
    for (int first = 0; first < G; first += H) {
        floats16 totals[H][C];
        for (int h = 0; h < H; ++h)
            for (int c = 0; c < C; ++c) totals[h][c] = sums[(r * G + first + h) * C + c];
        floats16 value[C];
        for (int64_t j = 0; j < length; ++j) {
            load_vector(view.fresh_values + path[j] * view.fresh_value_stride, C, dim, value);
            for (int h = 0; h < H; ++h) {
                const floats16 broadcast = floats16{} + weights[(r * G + first + h) * padded + view.committed + j];
                for (int c = 0; c < C; ++c) totals[h][c] = multiply_add(broadcast, value[c], totals[h][c]);
            }
        }
        for (int h = 0; h < H; ++h)
            for (int c = 0; c < C; ++c) sums[(r * G + first + h) * C + c] = totals[h][c];
    }
}

#if defined(__AVX512BF16__)
// bfloat16 values weighted two positions at a time: a row's weights are rounded to bfloat16 (as a bfloat16 model's
// attention casts its softmax before the product with the values) and each pair of positions (2k, 2k + 1) goes
// through one vdpbf16ps per sixteen dimensions, twice the multiply-adds of an instruction in float32, and read in
// place. Positions pair by their parity whether committed or this forward's, so a row's sums take the same steps
// wherever its keys sit. A pair's values are interleaved by unpacking within 128-bit lanes: accumulator ``2h`` holds
// dimensions ``32h + 8q + i`` and ``2h + 1`` dimensions ``32h + 8q + 4 + i`` at lane ``4q + i`` (see
// natural_chunk).

// The values at two positions (``dim`` = 32 * halves elements each) as ``2 * halves`` interleaved pair vectors.
template <int H>
inline void interleave_values(const c10::BFloat16* first, const c10::BFloat16* second, __m512bh* out) {
    for (int h = 0; h < H; ++h) {
        const __m512i a = _mm512_loadu_si512(first + 32 * h), b = _mm512_loadu_si512(second + 32 * h);
        out[2 * h] = (__m512bh)_mm512_unpacklo_epi16(a, b);
        out[2 * h + 1] = (__m512bh)_mm512_unpackhi_epi16(a, b);
    }
}

// Chunk ``c`` (dimensions 16c .. 16c + 15) of sums held in the interleaved order.
inline floats16 natural_chunk(const floats16* sums, int64_t c) {
    const floats16 low = sums[c & ~int64_t{1}], high = sums[c | 1];
    return (c & 1) ? __builtin_shufflevector(low, high, 8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31)
                   : __builtin_shufflevector(low, high, 0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
}

// Adds the committed position pairs ``(0, 1) .. (2 * pairs - 2, 2 * pairs - 1)`` to the sums of ``T`` rows from
// ``first``; ``weight_pairs`` holds each row's and head's weights as bfloat16 pairs, ``half`` of them per row.
template <int G, int C, int T>
inline void add_committed_value_pairs(const SequenceView<c10::BFloat16>& view, const uint32_t* weight_pairs,
                                      int64_t half, int64_t first, int64_t pairs, int64_t dim, floats16* sums) {
    __m512 totals[T][G][C];
    for (int t = 0; t < T; ++t)
        for (int g = 0; g < G; ++g)
            for (int c = 0; c < C; ++c) totals[t][g][c] = (__m512)sums[((first + t) * G + g) * C + c];
    __m512bh value[C];
    for (int64_t k = 0; k < pairs; ++k) {
        prefetch_value(view, 2 * k, dim);
        prefetch_value(view, 2 * k + 1, dim);
        interleave_values<C / 2>(view.value(2 * k, dim), view.value(2 * k + 1, dim), value);
        for (int t = 0; t < T; ++t)
            for (int g = 0; g < G; ++g) {
                const __m512bh weight = (__m512bh)_mm512_set1_epi32(
                    static_cast<int>(weight_pairs[((first + t) * G + g) * half + k]));
                for (int c = 0; c < C; ++c) totals[t][g][c] = _mm512_dpbf16_ps(totals[t][g][c], weight, value[c]);
            }
    }
    for (int t = 0; t < T; ++t)
        for (int g = 0; g < G; ++g)
            for (int c = 0; c < C; ++c) sums[((first + t) * G + g) * C + c] = (floats16)totals[t][g][c];
}

// The weighted values of ``rows`` rows (weights in ``scores``, rounded to bfloat16; totals in ``totals``), position
// pair by position pair, written to ``outputs``.
template <int G, int C>
void attend_value_pairs(const SequenceView<c10::BFloat16>& view, const float* scores, const float* totals,
                        int64_t padded, int64_t rows, const int64_t* const* paths, const int64_t* path_lengths,
                        int64_t dim, floats16* sums, std::vector<uint32_t>& pair_buffer,
                        c10::BFloat16* const* outputs) {
    const int64_t half = padded / 2;
    pair_buffer.resize(rows * G * half);
    uint32_t* weight_pairs = pair_buffer.data();
    for (int64_t i = 0; i < rows * G; ++i) {
        const uint32_t* bits = reinterpret_cast<const uint32_t*>(scores + i * padded);
        uint32_t* pairs = weight_pairs + i * half;
        int64_t k = 0;
        for (; k + kLanes <= half; k += kLanes) {
            words16 a, b;
            std::memcpy(&a, bits + 2 * k, sizeof(a));
            std::memcpy(&b, bits + 2 * k + kLanes, sizeof(b));
            const words16 even = __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
            const words16 odd = __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
            const words16 packed = (even >> 16) | (odd & 0xFFFF0000u);
            std::memcpy(pairs + k, &packed, sizeof(packed));
        }
        for (; k < half; ++k) pairs[k] = (bits[2 * k] >> 16) | (bits[2 * k + 1] & 0xFFFF0000u);
    }
    const int64_t committed_pairs = view.committed / 2;
    int64_t r = 0;
    if constexpr (G * C <= 12)  // two rows' sums in registers where they fit
        for (; r + 2 <= rows; r += 2)
            add_committed_value_pairs<G, C, 2>(view, weight_pairs, half, r, committed_pairs, dim, sums);
    for (; r < rows; ++r) add_committed_value_pairs<G, C, 1>(view, weight_pairs, half, r, committed_pairs, dim, sums);
    alignas(64) c10::BFloat16 zeros[16 * C] = {};  // the missing partner of a last even position (weight zero)
    __m512bh value[C];
    for (r = 0; r < rows; ++r) {
        const int64_t committed = view.committed, positions = committed + path_lengths[r];
        const auto value_at = [&](int64_t p) -> const c10::BFloat16* {
            if (p >= positions) return zeros;
            if (p < committed) return view.value(p, dim);
            return view.fresh_values + paths[r][p - committed] * view.fresh_value_stride;
        };
        for (int64_t p = 2 * committed_pairs; p < positions; p += 2) {
            interleave_values<C / 2>(value_at(p), value_at(p + 1), value);
            for (int g = 0; g < G; ++g) {
                const __m512bh weight = (__m512bh)_mm512_set1_epi32(static_cast<int>(weight_pairs[(r * G + g) * half + p / 2]));
                floats16* sum = sums + (r * G + g) * C;
                for (int c = 0; c < C; ++c) sum[c] = (floats16)_mm512_dpbf16_ps((__m512)sum[c], weight, value[c]);
            }
        }
        for (int g = 0; g < G; ++g) {
            const float total = totals[r * G + g];
            c10::BFloat16* out = outputs[r] + g * dim;
            for (int c = 0; c < C; ++c) store_lanes(out + c * kLanes, natural_chunk(sums + (r * G + g) * C, c) / total, kLanes);
        }
    }
}
#endif

// One sequence's rows (``rows`` of them; row ``r``'s path of ``path_lengths[r]`` new rows at ``paths[r]``) for one
// key head and its ``G`` query heads. Committed keys and values are read once for all the rows.
template <typename scalar_t, int G, int C, typename query_t = scalar_t>
void attend_sequence_head(const SequenceView<scalar_t>& view, const query_t* const* queries, query_t* const* outputs,
                          int64_t rows, const int64_t* const* paths, const int64_t* path_lengths, int64_t dim,
                          Scratch& scratch) {
    // C: the chunk count when known at compile time (head_dim 64 or 128), 0 otherwise.
    const int64_t chunks = C ? C : (dim + kLanes - 1) / kLanes;
    constexpr bool kPairedValues = kPairedBf16 && std::is_same_v<scalar_t, c10::BFloat16> && (C == 4 || C == 8);
    const int64_t committed = view.committed;
    int64_t longest = 0;
    for (int64_t r = 0; r < rows; ++r) longest = std::max(longest, path_lengths[r]);
    const int64_t padded = (committed + longest + kLanes - 1) / kLanes * kLanes;
    scratch.sums.assign(rows * G * chunks, floats16{});
    scratch.scores.resize(rows * G * padded);
    scratch.totals.resize(rows * G);
    float* scores = scratch.scores.data();
    floats16* sums = scratch.sums.data();

    floats16 vector[kMaxChunks];
#if defined(__AVX512BF16__)
    if constexpr (std::is_same_v<scalar_t, c10::BFloat16> && (C == 4 || C == 8)) {
        constexpr int P = 8 * C;  // dimension pairs
        const int64_t count = rows * G;
        scratch.query_heads.resize(count);
        for (int64_t r = 0; r < rows; ++r)
            for (int g = 0; g < G; ++g) scratch.query_heads[r * G + g] = queries[r] + g * dim;
        const c10::BFloat16* const* heads = scratch.query_heads.data();
        __m512i tile[P];
        const scalar_t* key_rows[kLanes];
        for (int64_t start = 0; start < committed; start += kLanes) {
            const int64_t keys = std::min<int64_t>(kLanes, committed - start);
            for (int64_t k = 0; k < kLanes; ++k) key_rows[k] = view.key(start + std::min<int64_t>(k, keys - 1), dim);
            for (int64_t p = start + kPrefetchAhead; p < std::min(committed, start + kPrefetchAhead + kLanes); ++p)
                prefetch(view.key(p, dim), dim);
            transpose_keys<P>(key_rows, tile);
            score_queries<P>(heads, count, tile, scores + start, padded, keys);
        }
        // This forward's keys: those of the rows on any row's path, sixteen at a time, each row scored against
        // the tiles its path's span meets (path_spans); then each path's scores picked out.
        const auto [lowest, highest] = path_spans(rows, paths, path_lengths, scratch.path_spans);
        if (highest >= 0) {
            const int64_t fresh_padded = (highest - lowest + kLanes) / kLanes * kLanes;
            scratch.fresh_scores.resize(count * fresh_padded);
            float* fresh = scratch.fresh_scores.data();
            for (int64_t start = lowest; start <= highest; start += kLanes) {
                const int64_t keys = std::min<int64_t>(kLanes, highest + 1 - start);
                for (int64_t k = 0; k < kLanes; ++k)
                    key_rows[k] = view.fresh_keys + (start + std::min<int64_t>(k, keys - 1)) * view.fresh_key_stride;
                transpose_keys<P>(key_rows, tile);
                for (int64_t r = 0; r < rows; ++r) {
                    if (span_meets(scratch.path_spans.data() + 2 * r, start))
                        score_queries<P>(heads + r * G, G, tile, fresh + r * G * fresh_padded + (start - lowest),
                                         fresh_padded, keys);
                }
            }
            pick_path_scores<G>(rows, paths, path_lengths, fresh, fresh_padded, lowest, scores, padded, committed);
        }
    } else
#endif
    if constexpr (kPairedBf16 && std::is_same_v<scalar_t, c10::BFloat16>) {
        // Keys and queries read in place, sixteen committed keys' lanes summed together.
        floats16 lanes[kLanes];
        const scalar_t* key_rows[kLanes];
        for (int64_t start = 0; start < committed; start += kLanes) {
            const int64_t count = std::min<int64_t>(kLanes, committed - start);
            for (int64_t k = 0; k < kLanes; ++k) {
                const int64_t p = start + std::min<int64_t>(k, count - 1);
                key_rows[k] = view.key(p, dim);
            }
            for (int64_t p = start + kPrefetchAhead; p < std::min(committed, start + kPrefetchAhead + kLanes); ++p)
                prefetch(view.key(p, dim), dim);
            for (int64_t r = 0; r < rows; ++r)
                for (int g = 0; g < G; ++g) {
                    for (int k = 0; k < kLanes; ++k) lanes[k] = score_lanes(queries[r] + g * dim, key_rows[k], dim);
                    const floats16 sums16 = horizontal_sums(lanes);
                    std::memcpy(scores + (r * G + g) * padded + start, &sums16, count * sizeof(float));
                }
        }
        for (int64_t r = 0; r < rows; ++r)
            for (int64_t j = 0; j < path_lengths[r]; ++j) {
                const scalar_t* key = view.fresh_keys + paths[r][j] * view.fresh_key_stride;
                for (int g = 0; g < G; ++g)
                    scores[(r * G + g) * padded + committed + j] = horizontal_sum(score_lanes(queries[r] + g * dim, key, dim));
            }
    } else {
        scratch.queries.resize(rows * G * chunks);
        floats16* query_vectors = scratch.queries.data();
        for (int64_t r = 0; r < rows; ++r)
            for (int g = 0; g < G; ++g)
                load_vector(queries[r] + g * dim, chunks, dim, query_vectors + (r * G + g) * chunks);
        // Committed keys sixteen at a time (their lanes summed together), converted once for all rows.
        // (a last tile of fewer keys repeats its last: each lane's score is its key's alone, and only ``count`` are
        // kept)
        floats16 keys[kLanes][kKeyStride<C>];
        for (int64_t start = 0; start < committed; start += kLanes) {
            const int64_t count = std::min<int64_t>(kLanes, committed - start);
            for (int64_t p = start + kPrefetchAhead; p < std::min(committed, start + kPrefetchAhead + kLanes); ++p)
                prefetch(view.key(p, dim), dim);
            for (int64_t k = 0; k < kLanes; ++k)
                load_vector(view.key(start + std::min<int64_t>(k, count - 1), dim), chunks, dim, keys[k]);
            score_keys<G>(query_vectors, keys, count, rows, chunks, scores, padded, start);
        }
        score_fresh_keys<scalar_t, G, C>(view, query_vectors, rows, paths, path_lengths, chunks, dim, scores,
                                         padded, scratch);
    }
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t positions = committed + path_lengths[r];
        for (int g = 0; g < G; ++g) {
            float* row = scores + (r * G + g) * padded;
            // (A maximum is the same whatever the order it is taken in: sixteen lanes, then across them.)
            floats16 lane_maxima = floats16{} - std::numeric_limits<float>::infinity();
            int64_t p = 0;
            for (; p + kLanes <= positions; p += kLanes) {
                const floats16 scores16 = load16(row + p);
                lane_maxima = scores16 > lane_maxima ? scores16 : lane_maxima;
            }
            float maximum = -std::numeric_limits<float>::infinity();
            for (int lane = 0; lane < kLanes; ++lane) maximum = std::max(maximum, lane_maxima[lane]);
            for (; p < positions; ++p) maximum = std::max(maximum, row[p]);
            for (int64_t p = positions; p < padded; ++p) row[p] = maximum;
            floats16 lanes = {};
            for (int64_t p = 0; p < padded; p += kLanes) {
                floats16 weights = exp_nonpositive(load16(row + p) - maximum);
                if constexpr (kPairedValues) {
                    // Rounded to bfloat16 (to nearest even; weights are finite) for the paired products, and the
                    // total taken of the rounded weights, so the result is their weighted average.
                    const words16 bits = reinterpret_cast<words16>(weights);
                    weights = reinterpret_cast<floats16>((bits + (((bits >> 16) & 1u) + 0x7FFFu)) & 0xFFFF0000u);
                }
                if (p + kLanes > positions)
                    for (int64_t lane = std::max<int64_t>(positions - p, 0); lane < kLanes; ++lane) weights[lane] = 0.0f;
                std::memcpy(row + p, &weights, sizeof(weights));
                lanes = lanes + weights;
            }
            scratch.totals[r * G + g] = horizontal_sum(lanes);
        }
    }
#if defined(__AVX512BF16__)
    if constexpr (kPairedValues) {
        attend_value_pairs<G, C>(view, scores, scratch.totals.data(), padded, rows, paths, path_lengths, dim, sums,
                                 scratch.weight_pairs, outputs);
        return;
    }
#endif
    if constexpr (C > 0 && G * C <= 12) {
        // Two rows at a time where their sums fit in registers (24 of them), one at a time otherwise.
        int64_t r = 0;
        for (; r + 2 <= rows; r += 2)
            add_committed_values<scalar_t, G, C, 2>(view, scores, r, dim, sums, padded);
        for (; r < rows; ++r) add_committed_values<scalar_t, G, C, 1>(view, scores, r, dim, sums, padded);
    } else if constexpr (C > 0 && G * C <= 32) {
        for (int64_t r = 0; r < rows; ++r) add_committed_values<scalar_t, G, C, 1>(view, scores, r, dim, sums, padded);
    } else {
        for (int64_t p = 0; p < committed; ++p) {
            prefetch_value(view, p, dim);
            load_vector(view.value(p, dim), chunks, dim, vector);
            add_value<G>(scores, vector, rows, chunks, sums, padded, p);
        }
    }
    for (int64_t r = 0; r < rows; ++r) {
        // (sums in registers pay over a prefill's long paths; a decoding row's or a draft's few values went 8 %
        // slower so)
        if (heads_per_pass(G, C) > 0 && path_lengths[r] >= kLanes) {
            if constexpr (heads_per_pass(G, C) > 0)
                add_path_values<scalar_t, G, C, heads_per_pass(G, C)>(view, scores, r, paths[r], path_lengths[r], dim,
                                                                       sums, padded);
        } else {
            for (int64_t j = 0; j < path_lengths[r]; ++j) {
                load_vector(view.fresh_values + paths[r][j] * view.fresh_value_stride, chunks, dim, vector);
                add_value<G>(scores + r * G * padded, vector, 1, chunks, sums + r * G * chunks, padded,
                             committed + j);
            }
        }
        for (int g = 0; g < G; ++g) {
            const floats16* sum = sums + (r * G + g) * chunks;
            const float total = scratch.totals[r * G + g];
            query_t* out = outputs[r] + g * dim;
            for (int64_t c = 0; c < chunks; ++c)
                store_lanes(out + c * kLanes, sum[c] / total, std::min<int64_t>(kLanes, dim - c * kLanes));
        }
    }
}

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
// The same arithmetic as attend_sequence_head, written for machines whose widest registers hold eight floats: GCC
// assembles sixteen-lane vectors in memory one lane at a time there (and compares and selects them lane by lane),
// which left this kernel at a tenth of the machine's speed. A sixteen-lane value is two registers (lanes 0-7, 8-15);
// every multiply-add, sum and pairwise pattern is the one above, so the results are bitwise the generic code's.
namespace avx2 {

constexpr int64_t kKeys = 8;  // keys scored together (their horizontal sums taken at once)

// Eight elements at ``source`` in float32 (exact conversions).
inline __m256 load8(const float* source) { return _mm256_loadu_ps(source); }
inline __m256 load8(const c10::BFloat16* source) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(source));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline __m256 load8(const c10::Half* source) {
#if defined(__F16C__)
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(source)));
#else
    alignas(32) float values[8];
    for (int i = 0; i < 8; ++i) values[i] = static_cast<float>(source[i]);
    return _mm256_load_ps(values);
#endif
}

// horizontal_sum of the sixteen lanes (low, high): halves, quarters, then (0 + 2) + (1 + 3).
inline float horizontal_sum8(__m256 low, __m256 high) {
    const __m256 eight = _mm256_add_ps(low, high);
    const __m128 four = _mm_add_ps(_mm256_castps256_ps128(eight), _mm256_extractf128_ps(eight, 1));
    const __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));  // (0 + 2), (1 + 3)
    return _mm_cvtss_f32(_mm_add_ss(two, _mm_movehdup_ps(two)));
}

// Eight horizontal sums at once (lane k: horizontal_sum8 of key k's halves, the same additions).
inline __m256 horizontal_sums8(const __m256* low, const __m256* high) {
    __m256 eight[8];
    for (int k = 0; k < 8; ++k) eight[k] = _mm256_add_ps(low[k], high[k]);
    __m256 four[4];  // keys (k, k + 4): quarters
    for (int k = 0; k < 4; ++k)
        four[k] = _mm256_add_ps(_mm256_permute2f128_ps(eight[k], eight[k + 4], 0x20),
                                _mm256_permute2f128_ps(eight[k], eight[k + 4], 0x31));
    __m256 two[2];  // (0 + 2), (1 + 3) of keys (0, 1 | 4, 5) and (2, 3 | 6, 7)
    for (int i = 0; i < 2; ++i)
        two[i] = _mm256_add_ps(_mm256_shuffle_ps(four[2 * i], four[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                               _mm256_shuffle_ps(four[2 * i], four[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm256_add_ps(_mm256_shuffle_ps(two[0], two[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm256_shuffle_ps(two[0], two[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// The scores of one query head (``query``: 16 * C floats) against eight keys: score_lanes then horizontal_sums.
template <typename scalar_t, int C>
inline __m256 score8(const float* query, const scalar_t* const* keys) {
    __m256 low[kKeys], high[kKeys];
    for (int half = 0; half < 2; ++half) {  // four keys at a time: eight chains of multiply-adds in flight
        __m256 sums[4][2];
        for (int k = 0; k < 4; ++k) sums[k][0] = sums[k][1] = _mm256_setzero_ps();
        for (int c = 0; c < C; ++c) {
            const __m256 q_low = _mm256_loadu_ps(query + 16 * c), q_high = _mm256_loadu_ps(query + 16 * c + 8);
            for (int k = 0; k < 4; ++k) {
                const scalar_t* key = keys[4 * half + k] + 16 * c;
                sums[k][0] = _mm256_fmadd_ps(q_low, load8(key), sums[k][0]);
                sums[k][1] = _mm256_fmadd_ps(q_high, load8(key + 8), sums[k][1]);
            }
        }
        for (int k = 0; k < 4; ++k) {
            low[4 * half + k] = sums[k][0];
            high[4 * half + k] = sums[k][1];
        }
    }
    return horizontal_sums8(low, high);
}

// Scores ``count`` (at most eight) keys for every row's query heads into ``scores`` (row r, head g at
// ``(r * G + g) * padded + at``).
template <typename scalar_t, int G, int C>
inline void score_tile(const float* queries, const scalar_t* const* keys, int64_t count, int64_t first_row,
                       int64_t rows, float* scores, int64_t padded, int64_t at) {
    for (int64_t r = first_row; r < first_row + rows; ++r)
        for (int g = 0; g < G; ++g) {
            alignas(32) float out[kKeys];
            _mm256_store_ps(out, score8<scalar_t, C>(queries + (r * G + g) * 16 * C, keys));
            std::memcpy(scores + (r * G + g) * padded + at, out, count * sizeof(float));
        }
}

// Adds positions [from, to) of ``values(p)``, weighted by ``weights[p]``, to the sums of D dimension chunks of
// eight (``sums``, in memory); one multiply-add per chunk per position, in position order.
template <typename scalar_t, int D, typename Values>
inline void add_values(const float* weights, int64_t from, int64_t to, Values&& values, float* sums) {
    __m256 totals[D];
    for (int d = 0; d < D; ++d) totals[d] = _mm256_loadu_ps(sums + 8 * d);
    for (int64_t p = from; p < to; ++p) {
        const __m256 weight = _mm256_broadcast_ss(weights + p);
        const scalar_t* value = values(p);
        for (int d = 0; d < D; ++d) totals[d] = _mm256_fmadd_ps(weight, load8(value + 8 * d), totals[d]);
    }
    for (int d = 0; d < D; ++d) _mm256_storeu_ps(sums + 8 * d, totals[d]);
}

template <typename scalar_t, int G, int C, typename query_t = scalar_t>
void attend_sequence_head(const SequenceView<scalar_t>& view, const query_t* const* queries, query_t* const* outputs,
                          int64_t rows, const int64_t* const* paths, const int64_t* path_lengths, int64_t dim,
                          Scratch& scratch) {
    constexpr int64_t kDim = 16 * C;
    const int64_t committed = view.committed;
    int64_t longest = 0;
    for (int64_t r = 0; r < rows; ++r) longest = std::max(longest, path_lengths[r]);
    // (draftwise::kLanes, the sixteen lanes: linear.cpp's avx2 namespace has a kLanes of its own when the sources
    // are compiled as one unit)
    constexpr int64_t kSixteen = draftwise::kLanes;
    const int64_t padded = (committed + longest + kSixteen - 1) / kSixteen * kSixteen;
    scratch.scores.resize(rows * G * padded);
    scratch.totals.resize(rows * G);
    scratch.sums.assign(rows * G * C, floats16{});
    scratch.queries.resize(rows * G * C);
    float* scores = scratch.scores.data();
    float* sums = reinterpret_cast<float*>(scratch.sums.data());  // (rows, G, kDim)
    float* query_floats = reinterpret_cast<float*>(scratch.queries.data());  // (rows, G, kDim)
    for (int64_t r = 0; r < rows; ++r)
        for (int g = 0; g < G; ++g)
            for (int64_t d = 0; d < kDim; d += 8)
                _mm256_storeu_ps(query_floats + (r * G + g) * kDim + d, load8(queries[r] + g * dim + d));

    // Committed keys eight at a time (a tile never crosses a cache block), read in place for every row.
    const scalar_t* keys[kKeys];
    for (int64_t start = 0; start < committed; start += kKeys) {
        const int64_t count = std::min<int64_t>(kKeys, committed - start);
        for (int64_t k = 0; k < kKeys; ++k) keys[k] = view.key(start + std::min<int64_t>(k, count - 1), dim);
        for (int64_t p = start + kPrefetchAhead; p < std::min(committed, start + kPrefetchAhead + kKeys); ++p)
            prefetch(view.key(p, dim), dim);
        score_tile<scalar_t, G, C>(query_floats, keys, count, 0, rows, scores, padded, start);
    }
    // Each row's keys on its path, eight at a time.
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t j = 0; j < path_lengths[r]; j += kKeys) {
            const int64_t count = std::min<int64_t>(kKeys, path_lengths[r] - j);
            for (int64_t k = 0; k < kKeys; ++k)
                keys[k] = view.fresh_keys + paths[r][j + std::min<int64_t>(k, count - 1)] * view.fresh_key_stride;
            score_tile<scalar_t, G, C>(query_floats, keys, count, r, 1, scores, padded, committed + j);
        }

    // Weights: exp(score - maximum), zero past a row's positions; their total in sixteen interleaved lanes.
    typedef float floats8 __attribute__((vector_size(32)));
    typedef int32_t ints8 __attribute__((vector_size(32)));
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t positions = committed + path_lengths[r];
        for (int g = 0; g < G; ++g) {
            float* row = scores + (r * G + g) * padded;
            __m256 lane_maxima = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
            int64_t p = 0;
            for (; p + 8 <= positions; p += 8) lane_maxima = _mm256_max_ps(_mm256_loadu_ps(row + p), lane_maxima);
            alignas(32) float maxima[8];
            _mm256_store_ps(maxima, lane_maxima);
            float maximum = -std::numeric_limits<float>::infinity();
            for (int lane = 0; lane < 8; ++lane) maximum = std::max(maximum, maxima[lane]);
            for (; p < positions; ++p) maximum = std::max(maximum, row[p]);
            for (p = positions; p < padded; ++p) row[p] = maximum;
            __m256 low = _mm256_setzero_ps(), high = _mm256_setzero_ps();
            const __m256 largest = _mm256_set1_ps(maximum);
            for (p = 0; p < padded; p += 8) {
                const floats8 shifted = (floats8)_mm256_sub_ps(_mm256_loadu_ps(row + p), largest);
                __m256 weights = (__m256)exp_nonpositive_lanes<floats8, ints8>(shifted);
                if (p + 8 > positions) {
                    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
                    const __m256i kept = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(positions - p)), lanes);
                    weights = _mm256_and_ps(weights, _mm256_castsi256_ps(kept));
                }
                _mm256_storeu_ps(row + p, weights);
                if ((p / 8) % 2 == 0) low = _mm256_add_ps(low, weights);
                else high = _mm256_add_ps(high, weights);
            }
            scratch.totals[r * G + g] = horizontal_sum8(low, high);
        }
    }

    // Values: committed positions in blocks of the cache (kept in the first-level cache for every row and head),
    // then each row's path; 64 dimensions (eight registers of sums) at a time.
    constexpr int D = 8;
    for (int64_t from = 0; from < committed; from += kCacheBlock) {
        const int64_t to = std::min(committed, from + kCacheBlock);
        for (int64_t p = from; p < to; ++p) prefetch_value(view, p, dim);
        for (int64_t r = 0; r < rows; ++r)
            for (int g = 0; g < G; ++g)
                for (int64_t d = 0; d < kDim; d += 8 * D)
                    add_values<scalar_t, D>(scores + (r * G + g) * padded, from, to,
                                            [&](int64_t p) { return view.value(p, dim) + d; },
                                            sums + (r * G + g) * kDim + d);
    }
    for (int64_t r = 0; r < rows; ++r) {
        for (int g = 0; g < G; ++g) {
            for (int64_t d = 0; d < kDim; d += 8 * D)
                add_values<scalar_t, D>(scores + (r * G + g) * padded + committed, 0, path_lengths[r],
                                        [&](int64_t j) {
                                            return view.fresh_values + paths[r][j] * view.fresh_value_stride + d;
                                        },
                                        sums + (r * G + g) * kDim + d);
            const __m256 total = _mm256_set1_ps(scratch.totals[r * G + g]);
            alignas(32) float averaged[kDim];
            for (int64_t d = 0; d < kDim; d += 8)
                _mm256_store_ps(averaged + d, _mm256_div_ps(_mm256_loadu_ps(sums + (r * G + g) * kDim + d), total));
            query_t* out = outputs[r] + g * dim;
            for (int64_t c = 0; c < C; ++c) store_lanes(out + c * kSixteen, load16(averaged + c * kSixteen), kSixteen);
        }
    }
}

}  // namespace avx2
#endif

template <typename scalar_t, typename query_t>
void attend_sequence(int64_t group, const SequenceView<scalar_t>& view, const query_t* const* queries,
                     query_t* const* outputs, int64_t rows, const int64_t* const* paths, const int64_t* path_lengths,
                     int64_t dim, Scratch& scratch) {
    // Heads of 64 or 128 dimensions: the eight-lane code on machines whose registers hold eight floats.
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define KERNEL avx2::attend_sequence_head
#else
#define KERNEL attend_sequence_head
#endif
    switch (group) {
#define DRAFTWISE_GROUP(G)                                                                                       \
        case G:                                                                                                      \
            if (dim == 64)                                                                                       \
                KERNEL<scalar_t, G, 4, query_t>(view, queries, outputs, rows, paths, path_lengths, dim, scratch);     \
            else if (dim == 128)                                                                                     \
                KERNEL<scalar_t, G, 8, query_t>(view, queries, outputs, rows, paths, path_lengths, dim, scratch);     \
            else                                                                                                     \
                attend_sequence_head<scalar_t, G, 0, query_t>(view, queries, outputs, rows, paths, path_lengths, dim, \
                                                              scratch);                                             \
            break;
        DRAFTWISE_GROUP(1) DRAFTWISE_GROUP(2) DRAFTWISE_GROUP(3) DRAFTWISE_GROUP(4)
        DRAFTWISE_GROUP(5) DRAFTWISE_GROUP(6) DRAFTWISE_GROUP(7) DRAFTWISE_GROUP(8)
#undef DRAFTWISE_GROUP
#undef KERNEL
        default: break;
    }
}

#undef DRAFTWISE_INLINE

}  // namespace

// query: (rows, heads, dim); new_keys, new_values: (rows, kv_heads, dim); key_caches, value_caches: per sequence,
// (layers, blocks, kv_heads, block, dim); row_sequence, row_committed: (rows,); path_offsets: (rows + 1,);
// path_rows: this forward's rows on each row's path, in position order. Returns (rows, heads * dim).
at::Tensor ragged_attention(
    const at::Tensor& query, const at::Tensor& new_keys, const at::Tensor& new_values,
    const std::vector<at::Tensor>& key_caches, const std::vector<at::Tensor>& value_caches, int64_t layer,
    const at::Tensor& row_sequence, const at::Tensor& row_committed, const at::Tensor& path_offsets,
    const at::Tensor& path_rows) {
    TORCH_CHECK(query.dim() == 3 && query.is_contiguous(), "query: contiguous (rows, heads, dim)");
    auto output = at::empty({query.size(0), query.size(1) * query.size(2)}, query.options());
    ragged_attention_into(query, new_keys, new_values, key_caches, value_caches, layer, row_sequence, row_committed,
                          path_offsets, path_rows, output);
    return output;
}

// As ragged_attention, into the first rows of ``output`` (contiguous, (>= rows, heads * dim), the query's dtype).
void ragged_attention_into(
    const at::Tensor& query, const at::Tensor& new_keys, const at::Tensor& new_values,
    const std::vector<at::Tensor>& key_caches, const std::vector<at::Tensor>& value_caches, int64_t layer,
    const at::Tensor& row_sequence, const at::Tensor& row_committed, const at::Tensor& path_offsets,
    const at::Tensor& path_rows, const at::Tensor& output) {
    TORCH_CHECK(query.dim() == 3 && query.is_contiguous(), "query: contiguous (rows, heads, dim)");
    // New keys and values may be column slices of a wider projection (rows apart by any stride).
    for (const auto* fresh : {&new_keys, &new_values})
        TORCH_CHECK(fresh->dim() == 3 && fresh->stride(2) == 1 && fresh->stride(1) == fresh->size(2),
                    "new keys and values: (rows, kv_heads, dim), each row's heads contiguous");
    TORCH_CHECK(key_caches.size() == value_caches.size() && !key_caches.empty(), "one key and value cache per sequence");
    const int64_t rows = query.size(0), heads = query.size(1), dim = query.size(2);
    const int64_t kv_heads = new_keys.size(1), group = heads / kv_heads;
    TORCH_CHECK(group >= 1 && group <= 8 && heads == group * kv_heads, "1 to 8 query heads per key/value head");
    TORCH_CHECK(dim <= kLanes * kMaxChunks, "head_dim up to 256");
    for (size_t s = 0; s < key_caches.size(); ++s) {
        TORCH_CHECK(key_caches[s].is_contiguous() && value_caches[s].is_contiguous(), "caches: contiguous");
        TORCH_CHECK(key_caches[s].dim() == 5 && key_caches[s].size(3) == kCacheBlock &&
                        key_caches[s].sizes() == value_caches[s].sizes() &&
                        key_caches[s].stride(1) == key_caches[0].stride(1),
                    "caches: (layers, blocks, kv_heads, ", kCacheBlock, ", dim), keys and values alike");
        TORCH_CHECK(key_caches[s].scalar_type() == key_caches[0].scalar_type() &&
                        value_caches[s].scalar_type() == key_caches[0].scalar_type(),
                    "every cache in one dtype");
    }
    // Keys and values are kept in the query's dtype, or in float16 beside float32 queries (a cache of half the
    // bytes; the keys and values are float16 values then, read exactly as float32, so the arithmetic is the float32
    // kernel's on them).
    const auto kv_type = key_caches[0].scalar_type();
    const bool half_kv = query.scalar_type() == at::kFloat && kv_type == at::kHalf;
    TORCH_CHECK(kv_type == query.scalar_type() || half_kv,
                "caches in the query's dtype, or float16 beside float32 queries");
    TORCH_CHECK(new_keys.scalar_type() == kv_type && new_values.scalar_type() == kv_type,
                "new keys and values in the caches' dtype");
    const int64_t* sequence_of = row_sequence.data_ptr<int64_t>();
    const int64_t* committed_of = row_committed.data_ptr<int64_t>();
    const int64_t* offsets = path_offsets.data_ptr<int64_t>();
    const int64_t* paths = path_rows.data_ptr<int64_t>();
    check_output_rows(output, rows, heads * dim, query.scalar_type(), "output");

    auto run = [&](auto query_zero, auto kv_zero) {
        using query_t = decltype(query_zero);
        using scalar_t = decltype(kv_zero);
        const query_t* queries = query.data_ptr<query_t>();
        const scalar_t* fresh_keys = new_keys.data_ptr<scalar_t>();
        const scalar_t* fresh_values = new_values.data_ptr<scalar_t>();
        const int64_t key_row_stride = new_keys.stride(0), value_row_stride = new_values.stride(0);
        std::vector<const scalar_t*> key_bases, value_bases;
        for (size_t s = 0; s < key_caches.size(); ++s) {
            key_bases.push_back(key_caches[s].data_ptr<scalar_t>() + layer * key_caches[s].stride(0));
            value_bases.push_back(value_caches[s].data_ptr<scalar_t>() + layer * value_caches[s].stride(0));
        }
        const int64_t block_stride = key_caches[0].stride(1), head_stride = key_caches[0].stride(2);
        query_t* out = output.data_ptr<query_t>();
        // Rows of one sequence are consecutive: find each sequence's first row. A sequence's rows are split into runs
        // of their own (a row's result does not depend on which rows share its run), so that threads get even shares:
        // into enough runs for a few (run, key head) tasks per thread where there are few sequences (one sequence's
        // tree over three key heads would leave one of two threads idle a third of the time), and into runs of at
        // most a few tasks' share of all the rows where one sequence holds most of them (a prompt piece beside other
        // sequences' decoding rows: whole, its runs went to one thread while the other finished the rest and waited).
        // The size split caps runs at no fewer than kSmallestRunCap rows: each run reads its committed keys again.
        // Threads take the tasks as they come free, the runs with the most rows and keys first.
        std::vector<int64_t> starts;
        for (int64_t row = 0; row < rows; ++row)
            if (row == 0 || sequence_of[row] != sequence_of[row - 1]) starts.push_back(row);
        const int64_t sequences = static_cast<int64_t>(starts.size());
        starts.push_back(rows);
        const int64_t threads = at::get_num_threads();
        const int64_t wanted = 4 * threads;
        const int64_t parts = std::max<int64_t>(1, (wanted + sequences * kv_heads - 1) / (sequences * kv_heads));
        const int64_t most_rows = std::max<int64_t>(kSmallestRunCap, (rows + wanted - 1) / wanted);
        std::vector<int64_t> firsts;
        for (int64_t s = 0; s < sequences; ++s) {
            const int64_t first = starts[s], count = starts[s + 1] - first;
            const int64_t pieces = std::min(count, std::max(parts, (count + most_rows - 1) / most_rows));
            for (int64_t piece = 0; piece < pieces; ++piece) firsts.push_back(first + count * piece / pieces);
        }
        firsts.push_back(rows);
        const int64_t runs = static_cast<int64_t>(firsts.size()) - 1;
        std::vector<int64_t> order(runs);  // runs by their work (rows times the keys of their last row), most first
        std::vector<int64_t> work(runs);
        for (int64_t run = 0; run < runs; ++run) {
            const int64_t last = firsts[run + 1] - 1;
            work[run] = (firsts[run + 1] - firsts[run]) * (committed_of[last] + offsets[last + 1] - offsets[last]);
            order[run] = run;
        }
        std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return work[a] > work[b]; });
        const int64_t tasks = runs * kv_heads;
        std::atomic<int64_t> next_task{0};
        at::parallel_for(0, std::min(threads, tasks), 1, [&](int64_t, int64_t) {
            Scratch scratch;
            std::vector<const query_t*> row_queries;
            std::vector<query_t*> row_outputs;
            std::vector<const int64_t*> row_paths;
            std::vector<int64_t> row_path_lengths;
            for (int64_t task = next_task.fetch_add(1, std::memory_order_relaxed); task < tasks;
                 task = next_task.fetch_add(1, std::memory_order_relaxed)) {
                const int64_t run = order[task / kv_heads], head = task % kv_heads;
                const int64_t first = firsts[run], count = firsts[run + 1] - first;
                const int64_t sequence = sequence_of[first];
                SequenceView<scalar_t> view{key_bases[sequence] + head * head_stride,
                                            value_bases[sequence] + head * head_stride,
                                            block_stride, committed_of[first],
                                            fresh_keys + head * dim, fresh_values + head * dim,
                                            key_row_stride, value_row_stride};
                row_queries.clear();
                row_outputs.clear();
                row_paths.clear();
                row_path_lengths.clear();
                for (int64_t row = first; row < first + count; ++row) {
                    row_queries.push_back(queries + (row * heads + head * group) * dim);
                    row_outputs.push_back(out + (row * heads + head * group) * dim);
                    row_paths.push_back(paths + offsets[row]);
                    row_path_lengths.push_back(offsets[row + 1] - offsets[row]);
                }
                attend_sequence<scalar_t, query_t>(group, view, row_queries.data(), row_outputs.data(), count,
                                          row_paths.data(), row_path_lengths.data(), dim, scratch);
            }
        });
    };
    if (half_kv) run(float{}, c10::Half{});
    else dispatch(query, [&](auto zero) { run(zero, zero); });
}
