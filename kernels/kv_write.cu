// Batched per-layer KV writes (docs/design.md §3.2).
//
// New tokens arrive as a ragged batch: K and V [num_tokens, H, D] per layer, token t belonging to
// batch row b when seq_offsets[b] <= t < seq_offsets[b + 1] (or b = t / uniform_tokens when
// seq_offsets is null). Token t lands at position
//     pos = positions[t]                                   if positions is given, else
//     pos = cache_lengths[b] + (t - start of row b)        (cache_lengths null: 0)
// of a cache slot:
//     contiguous caches: slot = row_to_slot[b] (null: b), token p = pos;
//     ring layers (KVLayerInfo.ring_window > 0, contiguous caches only): p = pos mod S, and a
//                        token with more than S later tokens in its row is skipped silently
//                        (only the last S tokens of a ragged prefill land; S = the window);
//     paged caches:      slot = block_table[b, pos / S], token p = pos % S (S = block size).
// Padding is skipped silently: tokens past the last row, position -1, slot/block -1.
// Anything else out of range (pos < -1, p >= S, a block-table column past its width, a slot
// outside [0, num_slots)) is skipped and counted in *status.
//
// Components: 2 writes K (kv 0) and V (kv 1); 1 writes only the rows of k (a latent MLA cache,
// one component per token; v is not read and may be null).
// Cache addressing, in bytes: slot * slot_stride + kv * kv_stride + head * head_stride +
// p * tok_stride. slot_stride == 0 means the layout [num_slots, C, H_l, S_l, D] (C = components)
// of the layer's KVLayerInfo (strides derived per layer, so heads may differ within a group).
//
// hc_kv_write copies rows of bytes. hc_kv_write_fp8 writes float32 / float16 / bfloat16 rows into
// a float8_e4m3fn or float8_e5m2 cache, quantizing each element on the way (docs/design.md §3.7):
// q = fp8(x / scale), the division in IEEE float32 (round to nearest), then round to nearest even
// into the format, saturating: finite values beyond the format's largest finite value and +-Inf
// become +-max (448 for e4m3fn, 57344 for e5m2), NaN stays NaN with the input's sign (e4m3fn
// 0x7f, e5m2 0x7e), -0 stays -0, values below half the smallest subnormal become +-0. The
// conversion is bit manipulation (no cuda_fp8.h), so g++ compiles it too; it equals ml_dtypes'
// cast of clip(x / scale, -max, max), which the NumPy reference computes. A scale should be
// finite and > 0; other scales give the IEEE quotients (x / 0 = +-Inf, which saturates), and a
// NaN quotient that the input did not carry has an unspecified sign.

#include "common.cuh"

// Row b of token t, or -1 for padding; *start and *end bound the row's tokens.
__device__ __forceinline__ int hc_token_row(const int* seq_offsets, int uniform_tokens, int batch,
                                            int t, int* start, hc_i64* end) {
    if (seq_offsets == nullptr) {
        if (uniform_tokens <= 0) return -1;
        const int b = t / uniform_tokens;
        if (b >= batch) return -1;
        *start = b * uniform_tokens;
        *end = (hc_i64)*start + uniform_tokens;
        return b;
    }
    if (batch <= 0 || t < seq_offsets[0] || t >= seq_offsets[batch]) return -1;
    int lo = 0, hi = batch - 1;  // largest b with seq_offsets[b] <= t
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (seq_offsets[mid] <= t) lo = mid; else hi = mid - 1;
    }
    *start = seq_offsets[lo];
    *end = seq_offsets[lo + 1];
    return lo;
}

struct HcWriteArgs {
    const int* seq_offsets;
    int uniform_tokens;
    int batch;
    int num_tokens;
    int parts;  // warps per token: a token's row groups are dealt out to this many warps
    const int* cache_lengths;
    const int* positions;
    const int* row_to_slot;
    const int* block_table;
    int max_blocks_per_seq;
    int num_slots;
    int components;
    int row_bytes;
    int paged;  // 1: block_table is the paged pools' table (explicit: an empty table's pointer
                // may be null on a GPU, and a paged write must not read it as "contiguous")
};

// Where token t lands in one layer: returns 0 and sets *dst (byte offset from info.data of the
// token's (component 0, head 0) row) to write it, 1 to skip it silently (padding), 2 to skip it
// and count it. Resolved once per token (by every lane of the token's warp, with the same
// loads, which the hardware broadcasts), never per chunk.
__device__ __forceinline__ int hc_token_target(const HcWriteArgs& a, const KVLayerInfo& info,
                                               int t, hc_i64 slot_stride, hc_i64 tok_stride,
                                               hc_i64* dst) {
    int start = 0;
    hc_i64 end = 0;
    const int b = hc_token_row(a.seq_offsets, a.uniform_tokens, a.batch, t, &start, &end);
    if (b < 0) return 1;
    const bool ring = info.ring_window > 0 && !a.paged;
    if (ring && end - t > info.max_seq_len) return 1;  // overwritten by a later token of its row
    // 64-bit: cache_lengths[b] + (t - start) may pass INT_MAX.
    const hc_i64 pos = a.positions != nullptr
                           ? (hc_i64)a.positions[t]
                           : (hc_i64)(a.cache_lengths != nullptr ? a.cache_lengths[b] : 0) +
                                 (t - start);
    if (pos == -1) return 1;
    if (pos < 0) return 2;
    int slot;
    hc_i64 p;
    if (a.paged) {
        // 0 <= pos < 2^32 (an int32 length plus an int32 token offset): 32-bit division.
        const unsigned S = (unsigned)info.max_seq_len;
        const hc_i64 col = (hc_i64)((unsigned)pos / S);
        if (col >= a.max_blocks_per_seq) return 2;
        slot = a.block_table[(hc_i64)b * a.max_blocks_per_seq + col];
        p = pos - col * S;
    } else {
        slot = a.row_to_slot != nullptr ? a.row_to_slot[b] : b;
        p = !ring ? pos : (hc_i64)((unsigned)pos % (unsigned)info.max_seq_len);
    }
    if (slot == -1) return 1;
    if (slot < 0 || slot >= a.num_slots || p >= info.max_seq_len) return 2;
    *dst = slot * slot_stride + p * tok_stride;
    return 0;
}

// Item j of a launch (part j % parts of token j / parts): sets *t, *part and *dst and returns
// true when the token is written; a skipped token that counts is reported once, by its first
// part's lane 0 in the first launched layer.
__device__ __forceinline__ bool hc_item_target(const HcWriteArgs& a, const KVLayerInfo& info,
                                               hc_i64 j, hc_i64 slot_stride, hc_i64 tok_stride,
                                               int* t, int* part, hc_i64* dst, int* status) {
    *t = (int)(j / a.parts);
    *part = (int)(j - (hc_i64)*t * a.parts);
    const int what = hc_token_target(a, info, *t, slot_stride, tok_stride, dst);
    if (what == 2 && (threadIdx.x & 31u) == 0 && *part == 0 && blockIdx.y == 0)
        hc_report(status);
    return what == 0;
}

// How the 32 lanes of a warp cover the rows of one token: 2^shift lanes per (component, head)
// row (the fewest that take a row's chunks in one pass, at most 32), 32 >> shift rows side by
// side; a lane takes chunks col, col + 2^shift, ... of rows sub, sub + (32 >> shift), ...
// Consecutive lanes hold consecutive chunks of a row, so loads and stores coalesce.
struct HcRowWalk {
    int rows;      // components * heads
    int chunks;    // per row
    int shift;     // log2(lanes per row)
    int per_lane;  // chunks of one row per lane: ceil(chunks / lanes per row)
    int sub;       // this lane's first row
    int col;       // this lane's first chunk
};

__device__ __forceinline__ HcRowWalk hc_row_walk(int rows, int chunks) {
    int s = 0;
    while (s < 5 && (1 << s) < chunks) ++s;
    const int lane = (int)(threadIdx.x & 31u);
    return HcRowWalk{rows, chunks, s, (chunks + (1 << s) - 1) >> s, lane >> s,
                     lane & ((1 << s) - 1)};
}

// Items a lane moves at once: its loads are all issued before its first store.
#define HC_IN_FLIGHT 4

// The warps of the launch: warp g of layer blockIdx.y takes items g, g + warps, ...; item j is
// part j % parts of token j / parts (parts > 1 when tokens are few: a decode step's 64 tokens
// would otherwise give a layer 64 warps, each walking its token's rows in several rounds).
__device__ __forceinline__ int hc_warp_id() {
    return (int)((blockIdx.x * blockDim.x + threadIdx.x) >> 5);
}
__device__ __forceinline__ int hc_warp_count() { return (int)((gridDim.x * blockDim.x) >> 5); }

template <int W>
__device__ void hc_kv_write_body(const HcWriteArgs& a, const KVLayerInfo& info, const char* k,
                                 const char* v, hc_i64 slot_stride, hc_i64 kv_stride,
                                 hc_i64 head_stride, hc_i64 tok_stride, int* status) {
    typedef typename HcVec<W>::T V;
    const int H = info.num_kv_heads;
    const HcRowWalk w = hc_row_walk(a.components * H, a.row_bytes / W);  // W | row_bytes
    const int row_step = 32 >> w.shift;
    char* const cache = reinterpret_cast<char*>(info.data);
    const int row_jump = row_step * a.parts;  // the rows a warp skips: the other parts'
    const hc_i64 items = (hc_i64)a.num_tokens * a.parts;
    for (hc_i64 j = hc_warp_id(); j < items; j += hc_warp_count()) {
        int t, part;
        hc_i64 dst = 0;
        if (!hc_item_target(a, info, j, slot_stride, tok_stride, &t, &part, &dst, status))
            continue;
        int r = w.sub + part * row_step, i = 0;
        while (r < w.rows) {
            V buf[HC_IN_FLIGHT];
            char* out[HC_IN_FLIGHT];
#pragma unroll
            for (int u = 0; u < HC_IN_FLIGHT; ++u) {
                out[u] = nullptr;
                if (r >= w.rows) continue;
                const int c = w.col + (i << w.shift);
                if (c < w.chunks) {
                    const int kv = r >= H ? 1 : 0;
                    const int head = r - kv * H;
                    const hc_i64 at = ((hc_i64)t * H + head) * a.row_bytes + (hc_i64)c * W;
                    buf[u] = *reinterpret_cast<const V*>((kv ? v : k) + at);
                    out[u] = cache + dst + kv * kv_stride + head * head_stride + (hc_i64)c * W;
                }
                if (++i == w.per_lane) {
                    i = 0;
                    r += row_jump;
                }
            }
#pragma unroll
            for (int u = 0; u < HC_IN_FLIGHT; ++u)
                if (out[u] != nullptr) *reinterpret_cast<V*>(out[u]) = buf[u];
        }
    }
}

// layers: the group's KVLayerInfo array; this launch writes layers layer_offset + blockIdx.y.
// srcs: KVSrcInfo [gridDim.y] (per launched layer), or null to use k_ptr / v_ptr (grid.y == 1).
// components: 2 (K and V) or 1 (latent: k only), the same for every layer of the group.
// paged: 1 when block_table addresses a paged pool (whatever its pointer), 0 for contiguous
// caches (block_table is then not read).
// Launch: grid (x, num_launched_layers), block (a multiple of 32); warps_per_token warps per
// token (x covers num_tokens * warps_per_token warps, or fewer: warps stride over the items).
// Any warps_per_token >= 1 writes the same bytes; it only spreads a token's rows.
extern "C" __global__ void __launch_bounds__(256, 5) hc_kv_write(const KVLayerInfo* __restrict__ layers, int layer_offset,
                                       const KVSrcInfo* __restrict__ srcs, hc_u64 k_ptr,
                                       hc_u64 v_ptr, const int* __restrict__ seq_offsets,
                                       int uniform_tokens, int batch, int num_tokens,
                                       int warps_per_token,
                                       const int* __restrict__ cache_lengths,
                                       const int* __restrict__ positions,
                                       const int* __restrict__ row_to_slot,
                                       const int* __restrict__ block_table,
                                       int max_blocks_per_seq, int paged, int num_slots,
                                       int components, int row_bytes,
                                       hc_i64 slot_stride, hc_i64 kv_stride, hc_i64 head_stride,
                                       hc_i64 tok_stride, int* status) {
    const KVLayerInfo info = layers[layer_offset + blockIdx.y];
    const hc_u64 k = srcs != nullptr ? srcs[blockIdx.y].k : k_ptr;
    const hc_u64 v = srcs != nullptr ? srcs[blockIdx.y].v : v_ptr;
    if (slot_stride == 0) {
        tok_stride = row_bytes;
        head_stride = (hc_i64)info.max_seq_len * row_bytes;
        kv_stride = info.num_kv_heads * head_stride;
        slot_stride = components * kv_stride;
    }
    const HcWriteArgs a = {seq_offsets, uniform_tokens, batch, num_tokens,
                           warps_per_token > 0 ? warps_per_token : 1, cache_lengths,
                           positions, row_to_slot, block_table, max_blocks_per_seq, num_slots,
                           components, row_bytes, paged};
    const int w = hc_vec_width(k | v | info.data | (hc_u64)row_bytes | (hc_u64)slot_stride |
                               (hc_u64)kv_stride | (hc_u64)head_stride | (hc_u64)tok_stride);
    HC_DISPATCH_WIDTH(w, hc_kv_write_body, a, info, reinterpret_cast<const char*>(k),
                      reinterpret_cast<const char*>(v), slot_stride, kv_stride, head_stride,
                      tok_stride, status);
}

// --- hc_kv_write_fp8: quantize on write ------------------------------------------------------

// Source element kinds (src_dtype): 0 float32, 1 float16, 2 bfloat16. FP8 formats (fp8_format):
// 0 float8_e4m3fn, 1 float8_e5m2.
#define HC_SRC_F32 0
#define HC_SRC_F16 1
#define HC_SRC_BF16 2
#define HC_FP8_E4M3FN 0
#define HC_FP8_E5M2 1

// float16 bits -> float32 bits, exactly (Inf kept, NaN payload kept).
__device__ __forceinline__ unsigned hc_f16_to_f32_bits(unsigned h) {
    const unsigned sign = (h & 0x8000u) << 16;
    const unsigned e = (h >> 10) & 0x1fu;
    const unsigned m = h & 0x3ffu;
    if (e == 0x1fu) return sign | 0x7f800000u | (m << 13);
    if (e != 0) return sign | ((e + 112u) << 23) | (m << 13);
    // zero or subnormal: m * 2^-24, exact in float32
    return sign | __float_as_uint((float)m * 5.9604644775390625e-08f);
}

// An FP8 format's constants (fp8_format 0: float8_e4m3fn, 1: float8_e5m2).
struct HcFp8 {
    int mant;           // mantissa bits
    int bias;           // exponent bias
    unsigned max_bits;  // the largest finite value, as float32 bits
    unsigned max_code;
    unsigned nan_code;
};

__device__ __forceinline__ HcFp8 hc_fp8_format(int fp8_format) {
    if (fp8_format == HC_FP8_E4M3FN) return HcFp8{3, 7, 0x43e00000u, 0x7eu, 0x7fu};  // 448
    return HcFp8{2, 15, 0x47600000u, 0x7bu, 0x7eu};                                   // 57344
}

// float32 bits -> FP8 byte: saturating (|x| >= max and +-Inf -> +-max), NaN -> sign | NaN code,
// round to nearest even (subnormals included).
__device__ __forceinline__ unsigned hc_f32_to_fp8(unsigned u, const HcFp8& f) {
    const unsigned sign = (u >> 24) & 0x80u;
    const unsigned a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return sign | f.nan_code;
    if (a >= f.max_bits) return sign | f.max_code;
    const int e = (int)(a >> 23);
    if (e > 127 - f.bias) {  // a normal number of the format: rebias, round off 23 - M bits
        const unsigned r = a - ((unsigned)(127 - f.bias) << 23);
        const int sh = 23 - f.mant;
        return sign | ((r + ((1u << (sh - 1)) - 1u) + ((r >> sh) & 1u)) >> sh);
    }
    // A subnormal of the format (or zero): the value is mant * 2^(e - 150), the format's
    // subnormal step 2^(1 - bias - M), so the code is mant >> (151 - bias - M - e), rounded.
    const int sh = 151 - f.bias - f.mant - e;  // >= 24 - M
    if (sh > 24) return sign;                  // below half the smallest subnormal (and zeros)
    const unsigned mant = (a & 0x7fffffu) | 0x800000u;
    return sign | ((mant + ((1u << (sh - 1)) - 1u) + ((mant >> sh) & 1u)) >> sh);
}

// One input element (its bits; src_dtype says which float) -> its FP8 byte.
__device__ __forceinline__ unsigned hc_quantize(unsigned x, int src_dtype, float scale,
                                                const HcFp8& f) {
    const unsigned u = src_dtype == HC_SRC_F32  ? x
                       : src_dtype == HC_SRC_F16 ? hc_f16_to_f32_bits(x)
                                                 : x << 16;
    // NaN first: its sign comes from the input on every device (a GPU's division returns a
    // canonical NaN, the host's keeps the operand's).
    if ((u & 0x7fffffffu) > 0x7f800000u) return hc_f32_to_fp8(u, f);
    return hc_f32_to_fp8(__float_as_uint(__fdiv_rn(__uint_as_float(u), scale)), f);
}

// CB bytes at p (16-byte aligned when CB >= 16, CB-aligned otherwise) into 32-bit words.
template <int CB>
__device__ __forceinline__ void hc_load_words(unsigned* w, const char* p) {
    if constexpr (CB >= 16) {
#pragma unroll
        for (int i = 0; i < CB / 16; ++i) {
            const uint4 q = reinterpret_cast<const uint4*>(p)[i];
            w[4 * i] = q.x;
            w[4 * i + 1] = q.y;
            w[4 * i + 2] = q.z;
            w[4 * i + 3] = q.w;
        }
    } else if constexpr (CB == 8) {
        const uint2 q = *reinterpret_cast<const uint2*>(p);
        w[0] = q.x;
        w[1] = q.y;
    } else if constexpr (CB == 4) {
        w[0] = *reinterpret_cast<const unsigned*>(p);
    } else {
        w[0] = *reinterpret_cast<const unsigned short*>(p);
    }
}

struct HcScaleArgs {
    const int* rows;      // the scale row of each group position
    const float* k;       // null: k_value for every layer and head
    const float* v;
    int k_layer_stride, k_head_stride, v_layer_stride, v_head_stride;
    float k_value, v_value;
};

struct HcQuantArgs {
    int row;        // the layer's scale row
    int src_dtype;
    HcFp8 fmt;
};

// Quantizes the E elements held in w (E * SZ bytes as loaded by hc_load_words) and stores their
// E bytes at d (E-byte aligned) with one store.
template <int E, int SZ>
__device__ __forceinline__ void hc_quantize_store(char* d, const unsigned* w,
                                                  const HcQuantArgs& q, float scale) {
    unsigned out[(E + 3) / 4];
#pragma unroll
    for (int i = 0; i < (E + 3) / 4; ++i) out[i] = 0;
#pragma unroll
    for (int j = 0; j < E; ++j) {
        unsigned x;
        if constexpr (SZ == 4) x = w[j];
        else x = (w[j >> 1] >> ((j & 1) * 16)) & 0xffffu;
        out[j >> 2] |= hc_quantize(x, q.src_dtype, scale, q.fmt) << ((j & 3) * 8);
    }
    if constexpr (E == 16) *reinterpret_cast<uint4*>(d) = uint4{out[0], out[1], out[2], out[3]};
    else if constexpr (E == 8) *reinterpret_cast<uint2*>(d) = uint2{out[0], out[1]};
    else if constexpr (E == 4) *reinterpret_cast<unsigned*>(d) = out[0];
    else if constexpr (E == 2) *reinterpret_cast<unsigned short*>(d) = (unsigned short)out[0];
    else *reinterpret_cast<unsigned char*>(d) = (unsigned char)out[0];
}

// Items a lane quantizes at once (each up to 64 input bytes in registers).
#define HC_FP8_IN_FLIGHT 2

// The rows of hc_kv_write, E elements (E input elements of SZ bytes in, E bytes out) per chunk.
template <int E, int SZ>
__device__ void hc_kv_write_fp8_body(const HcWriteArgs& a, const KVLayerInfo& info,
                                     const HcQuantArgs& q, const char* k, const char* v,
                                     const HcScaleArgs& sc, hc_i64 slot_stride,
                                     hc_i64 kv_stride, hc_i64 head_stride, hc_i64 tok_stride,
                                     int* status) {
    constexpr int NW = (E * SZ + 3) / 4;  // input words per chunk
    const int H = info.num_kv_heads;
    const int D = a.row_bytes;  // one byte per FP8 element; E | D
    const HcRowWalk w = hc_row_walk(a.components * H, D / E);
    const int row_step = 32 >> w.shift;
    char* const cache = reinterpret_cast<char*>(info.data);
    const int row_jump = row_step * a.parts;
    const hc_i64 items = (hc_i64)a.num_tokens * a.parts;
    for (hc_i64 j = hc_warp_id(); j < items; j += hc_warp_count()) {
        int t, part;
        hc_i64 dst = 0;
        if (!hc_item_target(a, info, j, slot_stride, tok_stride, &t, &part, &dst, status))
            continue;
        int r = w.sub + part * row_step, i = 0;
        while (r < w.rows) {
            unsigned in[HC_FP8_IN_FLIGHT][NW];
            char* out[HC_FP8_IN_FLIGHT];
            float scale[HC_FP8_IN_FLIGHT];
#pragma unroll
            for (int u = 0; u < HC_FP8_IN_FLIGHT; ++u) {
                out[u] = nullptr;
                scale[u] = 1.0f;
                if (r >= w.rows) continue;
                const int c = w.col + (i << w.shift);
                if (c < w.chunks) {
                    const int kv = r >= H ? 1 : 0;
                    const int head = r - kv * H;
                    const hc_i64 at = (((hc_i64)t * H + head) * D + (hc_i64)c * E) * SZ;
                    hc_load_words<E * SZ>(in[u], (kv ? v : k) + at);
                    const float* table = kv ? sc.v : sc.k;
                    scale[u] = table == nullptr
                                   ? (kv ? sc.v_value : sc.k_value)
                                   : table[(hc_i64)q.row * (kv ? sc.v_layer_stride
                                                               : sc.k_layer_stride) +
                                           (hc_i64)head * (kv ? sc.v_head_stride
                                                              : sc.k_head_stride)];
                    out[u] = cache + dst + kv * kv_stride + head * head_stride + (hc_i64)c * E;
                }
                if (++i == w.per_lane) {
                    i = 0;
                    r += row_jump;
                }
            }
#pragma unroll
            for (int u = 0; u < HC_FP8_IN_FLIGHT; ++u)
                if (out[u] != nullptr) hc_quantize_store<E, SZ>(out[u], in[u], q, scale[u]);
        }
    }
}

template <int SZ>
__device__ void hc_kv_write_fp8_width(int e, const HcWriteArgs& a, const KVLayerInfo& info,
                                      const HcQuantArgs& q, const char* k, const char* v,
                                      const HcScaleArgs& sc, hc_i64 slot_stride,
                                      hc_i64 kv_stride, hc_i64 head_stride, hc_i64 tok_stride,
                                      int* status) {
#define HC_FP8_CASE(E)                                                                   \
    hc_kv_write_fp8_body<E, SZ>(a, info, q, k, v, sc, slot_stride, kv_stride, head_stride, \
                                tok_stride, status)
    switch (e) {
        case 16: HC_FP8_CASE(16); break;
        case 8: HC_FP8_CASE(8); break;
        case 4: HC_FP8_CASE(4); break;
        case 2: HC_FP8_CASE(2); break;
        default: HC_FP8_CASE(1); break;
    }
#undef HC_FP8_CASE
}

// As hc_kv_write (same token mapping, status and launch), with float rows of src_dtype in,
// FP8 bytes of fp8_format out (head_dim elements, one byte each, per (token, head) row).
// Scales: layer row = scale_rows[layer_offset + blockIdx.y] (null: the group position);
// k_scales null: k_scale for every layer and head; else k_scales[row * k_layer_stride +
// head * k_head_stride] (likewise v). Chunks of E elements: E the largest power of two <= 16
// that keeps every FP8 store E-byte aligned and every input load min(16, E * itemsize)-byte
// aligned, so aligned rows move with 16-byte vectors on both sides.
extern "C" __global__ void __launch_bounds__(256, 4) hc_kv_write_fp8(
    const KVLayerInfo* __restrict__ layers, int layer_offset, const KVSrcInfo* __restrict__ srcs,
    hc_u64 k_ptr, hc_u64 v_ptr, const int* __restrict__ seq_offsets, int uniform_tokens,
    int batch, int num_tokens, int warps_per_token, const int* __restrict__ cache_lengths,
    const int* __restrict__ positions, const int* __restrict__ row_to_slot,
    const int* __restrict__ block_table, int max_blocks_per_seq, int paged, int num_slots,
    int components, int head_dim,
    int src_dtype, int fp8_format, const int* __restrict__ scale_rows,
    const float* __restrict__ k_scales, const float* __restrict__ v_scales, int k_layer_stride,
    int k_head_stride, int v_layer_stride, int v_head_stride, float k_scale, float v_scale,
    hc_i64 slot_stride, hc_i64 kv_stride, hc_i64 head_stride, hc_i64 tok_stride, int* status) {
    const int gp = layer_offset + blockIdx.y;
    const KVLayerInfo info = layers[gp];
    const hc_u64 k = srcs != nullptr ? srcs[blockIdx.y].k : k_ptr;
    const hc_u64 v = srcs != nullptr ? srcs[blockIdx.y].v : v_ptr;
    if (slot_stride == 0) {
        tok_stride = head_dim;
        head_stride = (hc_i64)info.max_seq_len * head_dim;
        kv_stride = info.num_kv_heads * head_stride;
        slot_stride = components * kv_stride;
    }
    const HcWriteArgs a = {seq_offsets, uniform_tokens, batch, num_tokens,
                           warps_per_token > 0 ? warps_per_token : 1, cache_lengths,
                           positions, row_to_slot, block_table, max_blocks_per_seq, num_slots,
                           components, head_dim, paged};
    const HcScaleArgs sc = {scale_rows, k_scales, v_scales, k_layer_stride, k_head_stride,
                            v_layer_stride, v_head_stride, k_scale, v_scale};
    const HcQuantArgs q = {scale_rows != nullptr ? scale_rows[gp] : gp, src_dtype,
                           hc_fp8_format(fp8_format)};
    const int size = src_dtype == HC_SRC_F32 ? 4 : 2;
    const int w_dst = hc_vec_width(info.data | (hc_u64)head_dim | (hc_u64)slot_stride |
                                   (hc_u64)kv_stride | (hc_u64)head_stride | (hc_u64)tok_stride);
    const int w_src = hc_vec_width(k | v | (hc_u64)head_dim * size);
    int e = w_dst;
    while (e > 1 && (e * size < 16 ? e * size : 16) > w_src) e >>= 1;
    const char* kc = reinterpret_cast<const char*>(k);
    const char* vc = reinterpret_cast<const char*>(v);
    if (size == 4)
        hc_kv_write_fp8_width<4>(e, a, info, q, kc, vc, sc, slot_stride, kv_stride, head_stride,
                                 tok_stride, status);
    else
        hc_kv_write_fp8_width<2>(e, a, info, q, kc, vc, sc, slot_stride, kv_stride, head_stride,
                                 tok_stride, status);
}

// Exported: hc_kv_write, hc_kv_write_fp8
