// Sequence-length bookkeeping on the device (part of the batch API, docs/design.md §4).
//
// hc_lengths_add: lengths[i] += (inc ? inc[i] : scalar) for i < n, all or nothing: if any
// increment is negative or any result would pass max_len, nothing changes and *status gets 1. The check and the update run in
// one thread so no other thread can observe a half-applied commit (n is at most max_batch).
// Launch: grid (1), block (1).

#include "common.cuh"

extern "C" __global__ void hc_lengths_add(int* __restrict__ lengths, int n,
                                          const int* __restrict__ inc, int scalar, int max_len,
                                          int* status) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    for (int i = 0; i < n; ++i) {
        const int add = inc != nullptr ? inc[i] : scalar;
        const hc_i64 next = (hc_i64)lengths[i] + add;
        if (add < 0 || next > max_len) {
            hc_report(status);
            return;
        }
    }
    for (int i = 0; i < n; ++i) lengths[i] += (inc != nullptr ? inc[i] : scalar);
}

// Exported: hc_lengths_add
