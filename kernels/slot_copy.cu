// Slot copies (docs/design.md §3.4): dst_t[dst_idx[i]] = src_t[src_idx[i]] for every tensor t of a set and
// every pair i, in one launch. Used for prompt-cache capture/restore of Mamba states, the Mamba
// prefix cache (store/restore), intermediate-state commits and paged-block copy-on-write.
//
// tensors: SlotTensorInfo [num_tensors]; slot i of a tensor is slot_bytes contiguous bytes.
// A pair with src or dst == -1 is padding and skipped; any other index outside
// [0, src_slots) / [0, dst_slots) is skipped and counted once per pair in *status.
// Pairs must not write a slot that another pair of the same launch reads.
// Launch: grid (x, num_tensors), block (B); blocks stride over the tiles of every pair
// (x: num_pairs * tiles per slot, or fewer).

#include "common.cuh"

// Chunks a thread moves at once: a block takes a tile of HC_SLOT_IN_FLIGHT * blockDim chunks of
// one pair, each thread loading all of its chunks before its first store (coalesced: thread j
// holds chunks j, j + blockDim, ...). The pair and its indices are resolved once per tile.
#define HC_SLOT_IN_FLIGHT 4

// I: the tile index type (32-bit when it fits, see hc_fits_u32). A slot has at least one tile
// (empty for an empty slot), so every pair is visited and a bad one counted.
template <int W, typename I>
__device__ void hc_slot_copy_impl(const SlotTensorInfo& t, const int* src_idx, const int* dst_idx,
                                  int num_pairs, int* status) {
    typedef typename HcVec<W>::T V;
    const hc_i64 chunks = t.slot_bytes / W;  // W | slot_bytes
    const hc_i64 tile = (hc_i64)HC_SLOT_IN_FLIGHT * blockDim.x;
    const I tiles = chunks > 0 ? (I)((chunks + tile - 1) / tile) : (I)1;
    const I total = (I)num_pairs * tiles;
    for (I g = (I)blockIdx.x; g < total; g += (I)gridDim.x) {
        const int i = (int)(g / tiles);
        const hc_i64 first = (hc_i64)(g - (I)i * tiles) * tile + threadIdx.x;
        const int s = src_idx[i];
        const int d = dst_idx[i];
        if (s == -1 || d == -1) continue;
        if (s < 0 || s >= t.src_slots || d < 0 || d >= t.dst_slots) {
            if (first == 0 && blockIdx.y == 0) hc_report(status);
            continue;
        }
        const V* src = reinterpret_cast<const V*>(t.src + s * t.slot_bytes) + first;
        V* dst = reinterpret_cast<V*>(t.dst + d * t.slot_bytes) + first;
        const hc_i64 left = chunks - first;  // chunks of this pair from this thread's first on
        V buf[HC_SLOT_IN_FLIGHT];
#pragma unroll
        for (int u = 0; u < HC_SLOT_IN_FLIGHT; ++u)
            if ((hc_i64)u * blockDim.x < left) buf[u] = src[(hc_i64)u * blockDim.x];
#pragma unroll
        for (int u = 0; u < HC_SLOT_IN_FLIGHT; ++u)
            if ((hc_i64)u * blockDim.x < left) dst[(hc_i64)u * blockDim.x] = buf[u];
    }
}

template <int W>
__device__ void hc_slot_copy_body(const SlotTensorInfo& t, const int* src_idx, const int* dst_idx,
                                  int num_pairs, int* status) {
    if (hc_fits_u32((hc_u64)num_pairs * (hc_u64)(t.slot_bytes > 0 ? t.slot_bytes : 1)))
        hc_slot_copy_impl<W, unsigned>(t, src_idx, dst_idx, num_pairs, status);
    else
        hc_slot_copy_impl<W, hc_u64>(t, src_idx, dst_idx, num_pairs, status);
}

extern "C" __global__ void __launch_bounds__(256, 5) hc_slot_copy(const SlotTensorInfo* __restrict__ tensors,
                                        const int* __restrict__ src_idx,
                                        const int* __restrict__ dst_idx, int num_pairs,
                                        int* status) {
    const SlotTensorInfo t = tensors[blockIdx.y];
    const int w = hc_vec_width(t.src | t.dst | (hc_u64)t.slot_bytes);
    HC_DISPATCH_WIDTH(w, hc_slot_copy_body, t, src_idx, dst_idx, num_pairs, status);
}

// Exported: hc_slot_copy
