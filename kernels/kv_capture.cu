// Prompt-cache capture and restore (docs/design.md §3.5): the first n tokens of slot `slot` of
// every layer of a head-dim group, to or from compact per-layer tensors [C, H_l, n, D] (C =
// components: 2 for K and V, 1 for a latent cache).
// A ring layer (KVLayerInfo.ring_window > 0, W = its max_seq_len) holds only the last
// m = min(n, W) of them, position p at p mod W: its compact tensor is [C, H_l, >= m, D] and holds
// positions n - m .. n - 1 in order (compact token j <-> ring entry (n - m + j) mod W).
//
// hc_kv_capture: one kernel for both directions (its to_cache argument). The ops kv_capture and
// kv_restore (hcache/ops/kv_capture.py) launch it with to_cache = 0 and 1 after checking the slot
// and the length; kv_prefix_copy launches it unchecked (the kernel skips and counts).
// cache:   KVLayerInfo [num_layers], caches [num_slots, C, H_l, S, D]
// compact: KVLayerInfo [num_layers], data = compact tensor, num_kv_heads = H_l, max_seq_len = n
// to_cache != 0 restores (compact -> cache); 0 captures (cache -> compact).
// A slot outside [0, num_slots), n > S, or a head-count mismatch skips the layer and counts it.
// Restore into several slots (one prompt, many requests): more_slots[0 .. num_more) are targets
// besides `slot`; grid.x holds 1 + num_more blocks of C * max_kv_heads, block group t writing
// target t (0: `slot`). A capture takes num_more = 0 (several targets would race on `compact`).
// Launch: grid ((1 + num_more) * C * max_kv_heads, num_layers, z), block (B).

#include "common.cuh"

// Copies n bytes between compact_span[0, n) and the cache span rotated by `first` bytes:
// compact byte x <-> cache byte (first + x) mod n (first = 0 for an unbounded layer). The two
// pieces meet at x = n - first, a multiple of W, so each chunk lies in one piece.
template <int W>
__device__ void hc_kv_capture_body(char* cache_span, char* compact_span, hc_i64 n, hc_i64 first,
                                   int to_cache) {
    const hc_i64 step = (hc_i64)gridDim.z * blockDim.x * W;
    const hc_i64 split = n - first;
    for (hc_i64 off = ((hc_i64)blockIdx.z * blockDim.x + threadIdx.x) * W; off < n; off += step) {
        // piece 1: compact [0, split) <-> cache [first, n); piece 2: [split, n) <-> [0, first)
        char* cache = off < split ? cache_span + first : cache_span;
        char* compact = off < split ? compact_span : compact_span + split;
        const hc_i64 o = off < split ? off : off - split;
        const hc_i64 lim = off < split ? split : first;
        if (to_cache) hc_copy_chunk<W>(cache, compact, o, lim);
        else hc_copy_chunk<W>(compact, cache, o, lim);
    }
}

extern "C" __global__ void hc_kv_capture(const KVLayerInfo* __restrict__ cache,
                                         const KVLayerInfo* __restrict__ compact, int slot,
                                         int num_tokens, int components, int row_bytes,
                                         int num_slots, int to_cache, int* status,
                                         const int* __restrict__ more_slots, int num_more) {
    const KVLayerInfo info = cache[blockIdx.y];
    const KVLayerInfo saved = compact[blockIdx.y];
    const int per_target = (int)gridDim.x / (1 + (num_more > 0 ? num_more : 0));
    const int target = (int)blockIdx.x / per_target;
    const int kvh = (int)blockIdx.x - target * per_target;
    if (target > 0) {
        if (!to_cache) return;   // one compact tensor per capture
        slot = more_slots[target - 1];
    }
    if (kvh >= components * info.num_kv_heads) return;
    const bool ring = info.ring_window > 0;
    // m: tokens held (the last min(n, W) of a ring); first: ring entry of the oldest of them
    const int m = ring && num_tokens > info.max_seq_len ? info.max_seq_len : num_tokens;
    const int first = ring && num_tokens > info.max_seq_len ? num_tokens % info.max_seq_len : 0;
    if (slot < 0 || slot >= num_slots || num_tokens < 0 || m > info.max_seq_len ||
        m > saved.max_seq_len || saved.num_kv_heads != info.num_kv_heads) {
        if (kvh == 0 && blockIdx.z == 0 && threadIdx.x == 0) hc_report(status);
        return;
    }
    const hc_i64 head_span = (hc_i64)info.max_seq_len * row_bytes;
    const hc_i64 saved_span = (hc_i64)saved.max_seq_len * row_bytes;
    char* cache_span = reinterpret_cast<char*>(info.data) +
                       slot * (components * (hc_i64)info.num_kv_heads * head_span) +
                       kvh * head_span;
    char* compact_span = reinterpret_cast<char*>(saved.data) + kvh * saved_span;
    const hc_i64 first_bytes = (hc_i64)first * row_bytes;
    const int w = hc_vec_width(info.data | saved.data | (hc_u64)head_span | (hc_u64)saved_span |
                               (hc_u64)first_bytes);
    HC_DISPATCH_WIDTH(w, hc_kv_capture_body, cache_span, compact_span, (hc_i64)m * row_bytes,
                      first_bytes, to_cache);
}

// Exported: hc_kv_capture
