// Sequence-length bookkeeping on the device (part of the batch API, docs/design.md §4).
//
// hc_lengths_add: lengths[i] += (inc ? inc[i] : scalar) for i < n, all or nothing: if any
// increment is negative or any result would pass max_len, nothing changes and *status gets 1.
// One block: every thread checks its entries, a barrier makes the verdict block-wide, then each
// thread updates the same entries it checked, so no entry is written before every check has
// read it, and no other launch observes a half-applied commit (stream order).
// Launch: grid (1), block (B, a multiple of 32, at most 1024); threads stride over n.

#include "common.cuh"

extern "C" __global__ void __launch_bounds__(1024) hc_lengths_add(
    int* __restrict__ lengths, int n, const int* __restrict__ inc, int scalar, int max_len,
    int* status) {
    __shared__ int refused;
    if (blockIdx.x != 0) return;
    if (threadIdx.x == 0) refused = 0;
    __syncthreads();
    bool bad = false;
    for (int i = (int)threadIdx.x; i < n; i += (int)blockDim.x) {
        const int add = inc != nullptr ? inc[i] : scalar;
        bad = bad || add < 0 || (hc_i64)lengths[i] + add > max_len;
    }
    if (bad) refused = 1;  // every writer stores the same value
    __syncthreads();
    if (refused) {
        if (threadIdx.x == 0) hc_report(status);
        return;
    }
    for (int i = (int)threadIdx.x; i < n; i += (int)blockDim.x)
        lengths[i] += (inc != nullptr ? inc[i] : scalar);
}

// Exported: hc_lengths_add
