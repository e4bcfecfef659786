// Slot copies (docs/design.md §3.4): dst_t[dst_idx[i]] = src_t[src_idx[i]] for every tensor t of a set and
// every pair i, in one launch. Used for prompt-cache capture/restore of Mamba states, the Mamba
// prefix cache (store/restore), intermediate-state commits and paged-block copy-on-write.
//
// tensors: SlotTensorInfo [num_tensors]; slot i of a tensor is slot_bytes contiguous bytes.
// A pair with src or dst == -1 is padding and skipped; any other index outside
// [0, src_slots) / [0, dst_slots) is skipped and counted once per pair in *status.
// Pairs must not write a slot that another pair of the same launch reads.
// Launch: grid (x, num_tensors), block (B); x covers num_pairs * chunks per slot.

#include "common.cuh"

// I: the flat index type (32-bit when it fits, see hc_fits_u32). A slot has at least one chunk
// (of zero bytes for an empty slot), so every pair is visited and a bad one counted.
template <int W, typename I>
__device__ void hc_slot_copy_impl(const SlotTensorInfo& t, const int* src_idx, const int* dst_idx,
                                  int num_pairs, int* status) {
    const I chunks = t.slot_bytes > 0 ? (I)((t.slot_bytes + W - 1) / W) : (I)1;
    const I total = (I)num_pairs * chunks;
    const I step = (I)gridDim.x * blockDim.x;
    for (I g = (I)blockIdx.x * blockDim.x + threadIdx.x; g < total; g += step) {
        const int i = (int)(g / chunks);
        const hc_i64 c = (hc_i64)(g - (I)i * chunks);
        const int s = src_idx[i];
        const int d = dst_idx[i];
        if (s == -1 || d == -1) continue;
        if (s < 0 || s >= t.src_slots || d < 0 || d >= t.dst_slots) {
            if (c == 0 && blockIdx.y == 0) hc_report(status);
            continue;
        }
        hc_copy_chunk<W>(reinterpret_cast<char*>(t.dst) + d * t.slot_bytes,
                         reinterpret_cast<const char*>(t.src) + s * t.slot_bytes, c * W,
                         t.slot_bytes);
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

extern "C" __global__ void hc_slot_copy(const SlotTensorInfo* __restrict__ tensors,
                                        const int* __restrict__ src_idx,
                                        const int* __restrict__ dst_idx, int num_pairs,
                                        int* status) {
    const SlotTensorInfo t = tensors[blockIdx.y];
    const int w = hc_vec_width(t.src | t.dst | (hc_u64)t.slot_bytes);
    HC_DISPATCH_WIDTH(w, hc_slot_copy_body, t, src_idx, dst_idx, num_pairs, status);
}

// Exported: hc_slot_copy
