// Speculative-decoding commits (docs/design.md §3.10): keep the accepted prefix of each
// sequence's draft tokens, for recurrent states and lengths alike, from device-resident counts.
//
// A row i of a launch is sequence slot s = row_to_slot ? row_to_slot[i] : i; it keeps
// kept = accepted[i] + bonus of the `written` tokens the engine wrote for it (bonus is 0 or 1:
// 1 when the first written token is the previous step's bonus token, always kept).
// The row's predicate (hc_draft_row, the same in both kernels):
//   s == -1                                  padding: skipped, not counted;
//   s outside [0, num_slots), accepted < 0, kept > min(written, draft_len), or (lengths given)
//   lengths[s] + kept > max_len              out of range: the row commits nothing (its state
//                                            and length stay), counted once in *status;
//   otherwise                                the row commits kept tokens.
// Rows must name distinct slots.
//
// hc_draft_accept: for every tensor t of a SlotSet (src: draft states, draft_len consecutive
// slots per sequence slot, [num_slots * draft_len] slots of slot_bytes; dst: live states
// [num_slots]) and every committing row with kept >= 1: dst_t[s] = src_t[s * draft_len + kept - 1]
// (the state after the last kept token). kept == 0 leaves the live state (the state before the
// drafts). lengths is read, never written: launch it before hc_draft_lengths.
// Launch: grid (x, num_tensors), block (B); x covers num_rows * chunks per slot.
//
// hc_draft_lengths: lengths[s] += kept for every committing row.
// Launch: grid (x), block (B); x covers num_rows.

#include "common.cuh"

// kept for a committing row, 0 for padding, -1 for a row out of range.
__device__ __forceinline__ hc_i64 hc_draft_row(int i, const int* accepted, const int* row_to_slot,
                                               int bonus, int written, int draft_len,
                                               int num_slots, const int* lengths, int max_len,
                                               int* slot) {
    const int s = row_to_slot != nullptr ? row_to_slot[i] : i;
    *slot = s;
    if (s == -1) return 0;
    const hc_i64 kept = (hc_i64)accepted[i] + bonus;
    const hc_i64 cap = written < draft_len ? written : draft_len;
    if (s < 0 || s >= num_slots || accepted[i] < 0 || kept > cap) return -1;
    if (lengths != nullptr && (hc_i64)lengths[s] + kept > max_len) return -1;
    return kept;
}

template <int W, typename I>
__device__ void hc_draft_accept_impl(const SlotTensorInfo& t, const int* accepted,
                                     const int* row_to_slot, int num_rows, int draft_len,
                                     int written, int bonus, const int* lengths, int max_len,
                                     int* status) {
    const I chunks = t.slot_bytes > 0 ? (I)((t.slot_bytes + W - 1) / W) : (I)1;
    const I total = (I)num_rows * chunks;
    const I step = (I)gridDim.x * blockDim.x;
    for (I g = (I)blockIdx.x * blockDim.x + threadIdx.x; g < total; g += step) {
        const int i = (int)(g / chunks);
        const hc_i64 c = (hc_i64)(g - (I)i * chunks);
        int s;
        const hc_i64 kept = hc_draft_row(i, accepted, row_to_slot, bonus, written, draft_len,
                                         t.dst_slots, lengths, max_len, &s);
        const hc_i64 src = (hc_i64)s * draft_len + kept - 1;
        if (kept < 0 || (kept > 0 && src >= t.src_slots)) {
            if (c == 0 && blockIdx.y == 0) hc_report(status);
            continue;
        }
        if (kept == 0) continue;
        hc_copy_chunk<W>(reinterpret_cast<char*>(t.dst) + s * t.slot_bytes,
                         reinterpret_cast<const char*>(t.src) + src * t.slot_bytes, c * W,
                         t.slot_bytes);
    }
}

template <int W>
__device__ void hc_draft_accept_body(const SlotTensorInfo& t, const int* accepted,
                                     const int* row_to_slot, int num_rows, int draft_len,
                                     int written, int bonus, const int* lengths, int max_len,
                                     int* status) {
    if (hc_fits_u32((hc_u64)num_rows * (hc_u64)(t.slot_bytes > 0 ? t.slot_bytes : 1)))
        hc_draft_accept_impl<W, unsigned>(t, accepted, row_to_slot, num_rows, draft_len, written,
                                          bonus, lengths, max_len, status);
    else
        hc_draft_accept_impl<W, hc_u64>(t, accepted, row_to_slot, num_rows, draft_len, written,
                                        bonus, lengths, max_len, status);
}

extern "C" __global__ void hc_draft_accept(const SlotTensorInfo* __restrict__ tensors,
                                           const int* __restrict__ accepted,
                                           const int* __restrict__ row_to_slot, int num_rows,
                                           int draft_len, int written, int bonus,
                                           const int* __restrict__ lengths, int max_len,
                                           int* status) {
    const SlotTensorInfo t = tensors[blockIdx.y];
    const int w = hc_vec_width(t.src | t.dst | (hc_u64)t.slot_bytes);
    HC_DISPATCH_WIDTH(w, hc_draft_accept_body, t, accepted, row_to_slot, num_rows, draft_len,
                      written, bonus, lengths, max_len, status);
}

extern "C" __global__ void hc_draft_lengths(int* __restrict__ lengths, int num_slots,
                                            const int* __restrict__ accepted,
                                            const int* __restrict__ row_to_slot, int num_rows,
                                            int written, int bonus, int max_len, int* status) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < num_rows;
         i += gridDim.x * blockDim.x) {
        int s;
        // draft_len = written: the lengths kernel has no draft buffer to bound.
        const hc_i64 kept = hc_draft_row(i, accepted, row_to_slot, bonus, written, written,
                                         num_slots, lengths, max_len, &s);
        if (kept < 0) {
            hc_report(status);
            continue;
        }
        if (kept > 0) lengths[s] += (int)kept;
    }
}

// Exported: hc_draft_accept, hc_draft_lengths
