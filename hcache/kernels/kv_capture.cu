// Prompt-cache capture and restore (docs/design.md §3.5): the first n tokens of slot `slot` of
// every layer of a head-dim group, to or from compact per-layer tensors [C, H_l, n, D] (C =
// components: 2 for K and V, 1 for a latent cache).
//
// hc_kv_capture: one kernel for both directions (its to_cache argument). The ops kv_capture and
// kv_restore (hcache/ops/kv_capture.py) launch it with to_cache = 0 and 1 after checking the slot
// and the length; kv_prefix_copy launches it unchecked (the kernel skips and counts).
// cache:   KVLayerInfo [num_layers], caches [num_slots, C, H_l, S, D]
// compact: KVLayerInfo [num_layers], data = compact tensor, num_kv_heads = H_l, max_seq_len = n
// to_cache != 0 restores (compact -> cache); 0 captures (cache -> compact).
// A slot outside [0, num_slots), n > S, or a head-count mismatch skips the layer and counts it.
// Launch: grid (C * max_kv_heads, num_layers, z), block (B).

#include "common.cuh"

template <int W>
__device__ void hc_kv_capture_body(char* cache_span, char* compact_span, hc_i64 n,
                                   int to_cache) {
    const hc_i64 step = (hc_i64)gridDim.z * blockDim.x * W;
    for (hc_i64 off = ((hc_i64)blockIdx.z * blockDim.x + threadIdx.x) * W; off < n; off += step) {
        if (to_cache) hc_copy_chunk<W>(cache_span, compact_span, off, n);
        else hc_copy_chunk<W>(compact_span, cache_span, off, n);
    }
}

extern "C" __global__ void hc_kv_capture(const KVLayerInfo* __restrict__ cache,
                                         const KVLayerInfo* __restrict__ compact, int slot,
                                         int num_tokens, int components, int row_bytes,
                                         int num_slots, int to_cache, int* status) {
    const KVLayerInfo info = cache[blockIdx.y];
    const KVLayerInfo saved = compact[blockIdx.y];
    const int kvh = blockIdx.x;
    if (kvh >= components * info.num_kv_heads) return;
    if (slot < 0 || slot >= num_slots || num_tokens < 0 || num_tokens > info.max_seq_len ||
        num_tokens > saved.max_seq_len || saved.num_kv_heads != info.num_kv_heads) {
        if (kvh == 0 && blockIdx.z == 0 && threadIdx.x == 0) hc_report(status);
        return;
    }
    const hc_i64 head_span = (hc_i64)info.max_seq_len * row_bytes;
    const hc_i64 saved_span = (hc_i64)saved.max_seq_len * row_bytes;
    char* cache_span = reinterpret_cast<char*>(info.data) +
                       slot * (components * (hc_i64)info.num_kv_heads * head_span) +
                       kvh * head_span;
    char* compact_span = reinterpret_cast<char*>(saved.data) + kvh * saved_span;
    const int w = hc_vec_width(info.data | saved.data | (hc_u64)head_span | (hc_u64)saved_span);
    HC_DISPATCH_WIDTH(w, hc_kv_capture_body, cache_span, compact_span,
                      (hc_i64)num_tokens * row_bytes, to_cache);
}

// Exported: hc_kv_capture
