// Batched per-layer KV writes (docs/design.md §3.2).
//
// New tokens arrive as a ragged batch: K and V [num_tokens, H, D] per layer, token t belonging to
// batch row b when seq_offsets[b] <= t < seq_offsets[b + 1] (or b = t / uniform_tokens when
// seq_offsets is null). Token t lands at position
//     pos = positions[t]                                   if positions is given, else
//     pos = cache_lengths[b] + (t - start of row b)        (cache_lengths null: 0)
// of a cache slot:
//     contiguous caches: slot = row_to_slot[b] (null: b), token p = pos;
//     paged caches:      slot = block_table[b, pos / S], token p = pos % S (S = block size).
// Padding is skipped silently: tokens past the last row, position -1, slot/block -1.
// Anything else out of range (pos < -1, p >= S, a block-table column past its width, a slot
// outside [0, num_slots)) is skipped and counted in *status.
//
// Cache addressing, in bytes: slot * slot_stride + kv * kv_stride + head * head_stride +
// p * tok_stride. slot_stride == 0 means the layout [num_slots, 2, H_l, S_l, D] of the layer's
// KVLayerInfo (strides derived per layer, so heads may differ within a group).

#include "common.cuh"

// Row b of token t, or -1 for padding.
__device__ __forceinline__ int hc_token_row(const int* seq_offsets, int uniform_tokens, int batch,
                                            int t, int* start) {
    if (seq_offsets == nullptr) {
        if (uniform_tokens <= 0) return -1;
        const int b = t / uniform_tokens;
        if (b >= batch) return -1;
        *start = b * uniform_tokens;
        return b;
    }
    if (batch <= 0 || t < seq_offsets[0] || t >= seq_offsets[batch]) return -1;
    int lo = 0, hi = batch - 1;  // largest b with seq_offsets[b] <= t
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (seq_offsets[mid] <= t) lo = mid; else hi = mid - 1;
    }
    *start = seq_offsets[lo];
    return lo;
}

struct HcWriteArgs {
    const int* seq_offsets;
    int uniform_tokens;
    int batch;
    int num_tokens;
    const int* cache_lengths;
    const int* positions;
    const int* row_to_slot;
    const int* block_table;
    int max_blocks_per_seq;
    int num_slots;
    int row_bytes;
};

// I: the flat index type (32-bit when it fits, see hc_fits_u32).
template <int W, typename I>
__device__ void hc_kv_write_impl(const HcWriteArgs& a, const KVLayerInfo& info, const char* k,
                                 const char* v, hc_i64 slot_stride, hc_i64 kv_stride,
                                 hc_i64 head_stride, hc_i64 tok_stride, int* status) {
    const int H = info.num_kv_heads;
    const I chunks = (I)((a.row_bytes + W - 1) / W);
    const I heads2 = (I)(2 * H);
    const I total = (I)a.num_tokens * heads2 * chunks;
    const I step = (I)gridDim.x * blockDim.x;
    for (I g = (I)blockIdx.x * blockDim.x + threadIdx.x; g < total; g += step) {
        const I c = g % chunks;
        const I r = g / chunks;
        const int kvh = (int)(r % heads2);
        const int t = (int)(r / heads2);
        const bool reporter = (c == 0 && kvh == 0 && blockIdx.y == 0);
        int start = 0;
        const int b = hc_token_row(a.seq_offsets, a.uniform_tokens, a.batch, t, &start);
        if (b < 0) continue;
        // 64-bit: cache_lengths[b] + (t - start) may pass INT_MAX.
        const hc_i64 pos = a.positions != nullptr
                               ? (hc_i64)a.positions[t]
                               : (hc_i64)(a.cache_lengths != nullptr ? a.cache_lengths[b] : 0) +
                                     (t - start);
        if (pos == -1) continue;
        if (pos < 0) {
            if (reporter) hc_report(status);
            continue;
        }
        int slot;
        hc_i64 p;
        if (a.block_table != nullptr) {
            const int S = info.max_seq_len;  // 32-bit division unless pos needs 64 bits
            const hc_i64 col = pos <= 0x7fffffff ? (hc_i64)((int)pos / S) : pos / S;
            if (col >= a.max_blocks_per_seq) {
                if (reporter) hc_report(status);
                continue;
            }
            slot = a.block_table[(hc_i64)b * a.max_blocks_per_seq + col];
            p = pos - col * S;
        } else {
            slot = a.row_to_slot != nullptr ? a.row_to_slot[b] : b;
            p = pos;
        }
        if (slot == -1) continue;
        if (slot < 0 || slot >= a.num_slots || p >= info.max_seq_len) {
            if (reporter) hc_report(status);
            continue;
        }
        const int kv = kvh / H;
        const int head = kvh - kv * H;
        char* dst = reinterpret_cast<char*>(info.data) + slot * slot_stride + kv * kv_stride +
                    head * head_stride + p * tok_stride;
        const char* src = (kv ? v : k) + ((hc_i64)t * H + head) * a.row_bytes;
        hc_copy_chunk<W>(dst, src, (hc_i64)c * W, a.row_bytes);
    }
}

template <int W>
__device__ void hc_kv_write_body(const HcWriteArgs& a, const KVLayerInfo& info, const char* k,
                                 const char* v, hc_i64 slot_stride, hc_i64 kv_stride,
                                 hc_i64 head_stride, hc_i64 tok_stride, int* status) {
    const hc_u64 bound = (hc_u64)a.num_tokens * 2 * info.num_kv_heads * a.row_bytes;
    if (hc_fits_u32(bound))
        hc_kv_write_impl<W, unsigned>(a, info, k, v, slot_stride, kv_stride, head_stride,
                                      tok_stride, status);
    else
        hc_kv_write_impl<W, hc_u64>(a, info, k, v, slot_stride, kv_stride, head_stride,
                                    tok_stride, status);
}

// layers: the group's KVLayerInfo array; this launch writes layers layer_offset + blockIdx.y.
// srcs: KVSrcInfo [gridDim.y] (per launched layer), or null to use k_ptr / v_ptr (grid.y == 1).
// Launch: grid (x, num_launched_layers), block (B); x covers tokens * 2 * H * chunks per row.
extern "C" __global__ void hc_kv_write(const KVLayerInfo* __restrict__ layers, int layer_offset,
                                       const KVSrcInfo* __restrict__ srcs, hc_u64 k_ptr,
                                       hc_u64 v_ptr, const int* __restrict__ seq_offsets,
                                       int uniform_tokens, int batch, int num_tokens,
                                       const int* __restrict__ cache_lengths,
                                       const int* __restrict__ positions,
                                       const int* __restrict__ row_to_slot,
                                       const int* __restrict__ block_table,
                                       int max_blocks_per_seq, int num_slots, int row_bytes,
                                       hc_i64 slot_stride, hc_i64 kv_stride, hc_i64 head_stride,
                                       hc_i64 tok_stride, int* status) {
    const KVLayerInfo info = layers[layer_offset + blockIdx.y];
    const hc_u64 k = srcs != nullptr ? srcs[blockIdx.y].k : k_ptr;
    const hc_u64 v = srcs != nullptr ? srcs[blockIdx.y].v : v_ptr;
    if (slot_stride == 0) {
        tok_stride = row_bytes;
        head_stride = (hc_i64)info.max_seq_len * row_bytes;
        kv_stride = info.num_kv_heads * head_stride;
        slot_stride = 2 * kv_stride;
    }
    const HcWriteArgs a = {seq_offsets, uniform_tokens, batch, num_tokens, cache_lengths,
                           positions, row_to_slot, block_table, max_blocks_per_seq, num_slots,
                           row_bytes};
    const int w = hc_vec_width(k | v | info.data | (hc_u64)row_bytes | (hc_u64)slot_stride |
                               (hc_u64)kv_stride | (hc_u64)head_stride | (hc_u64)tok_stride);
    HC_DISPATCH_WIDTH(w, hc_kv_write_body, a, info, reinterpret_cast<const char*>(k),
                      reinterpret_cast<const char*>(v), slot_stride, kv_stride, head_stride,
                      tok_stride, status);
}

// Exported: hc_kv_write
