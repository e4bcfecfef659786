// Mapping-based batch compaction (docs/design.md §3.3): mapping[old] = new slot, or -1 (evicted).
//
// Correct for any injective mapping of [0, old_batch) into [0, new_batch), in place, without
// scratch memory. hc_compaction_plan turns the mapping into a schedule of slot moves:
//   * a chain a1 -> a2 -> ... -> ak (ak's own content is not needed) runs from its end backwards,
//     so every slot is read before it is overwritten;
//   * a cycle m -> x -> ... -> m saves m into a per-thread register first (HC_TMP), moves the rest
//     backwards, then stores the register; a monotone mapping has no cycles;
//   * a slot below new_batch that receives nothing gets an HC_CLEAR entry (at the end).
// The copy kernels then run the whole schedule once per tile of chunks they own (each entry
// resolved once per tile, its chunks loaded before they are stored); since one thread owns a
// chunk offset in every slot (common.cuh), program order alone orders reads before writes.
//
// Plan layout (int32, 4 + 8 max_batch entries; mirrored by hcache/ops/tables.py, whose
// compaction_plan_size, PLAN_HEADER, TMP and CLEAR follow the defines below):
//   [0] status: 0 valid, 1 mapping not injective into [0, new_batch), 2 bad batch sizes
//   [1] number of schedule entries      [2] max length (tokens) over moved slots
//   [3] first offending old index, or -1
//   [4, 4 + max_batch)                  inverse mapping: inv[new] = old, or -1
//   [4 + max_batch, 4 + 2 max_batch)    done flags (plan construction only)
//   [4 + 2 max_batch, ...)              schedule: (src, dst) pairs, at most 3 max_batch of them

#include "common.cuh"

#define HC_PLAN_STATUS 0
#define HC_PLAN_COUNT 1
#define HC_PLAN_MAX_LEN 2
#define HC_PLAN_BAD_INDEX 3
#define HC_PLAN_HEADER 4
#define HC_TMP (-2)
#define HC_CLEAR (-3)

__device__ __forceinline__ const int* hc_plan_schedule(const int* plan, int max_batch) {
    return plan + HC_PLAN_HEADER + 2 * max_batch;
}

// The plan's entry count, clamped to the schedule's capacity (3 max_batch pairs): the copy
// kernels never read past the plan, whatever its header says.
__device__ __forceinline__ int hc_plan_count(const int* plan, int max_batch) {
    const int n = plan[HC_PLAN_COUNT];
    return n < 0 ? 0 : (n > 3 * max_batch ? 3 * max_batch : n);
}

// Appends (src, dst) entries and tracks the longest moved span.
struct HcSchedule {
    int* pairs;
    int count;
    int max_len;
    const int* lengths;

    __device__ void move(int src, int dst) {
        pairs[2 * count] = src;
        pairs[2 * count + 1] = dst;
        ++count;
        if (src >= 0 && lengths != nullptr && lengths[src] > max_len) max_len = lengths[src];
    }
};

// The schedule built by one thread, O(max_batch): the definition the block-wide build below
// reproduces entry for entry, and the path for a max_batch past the block.
__device__ void hc_plan_serial(const int* mapping, int old_batch, int new_batch, int max_batch,
                               const int* lengths, int* plan) {
    int* inv = plan + HC_PLAN_HEADER;
    int* done = inv + max_batch;
    int* sched = done + max_batch;
    plan[HC_PLAN_COUNT] = 0;
    plan[HC_PLAN_MAX_LEN] = 0;
    plan[HC_PLAN_BAD_INDEX] = -1;
    if (max_batch < 0 || old_batch < 0 || old_batch > max_batch || new_batch < 0 ||
        new_batch > max_batch) {
        plan[HC_PLAN_STATUS] = 2;
        return;
    }
    for (int i = 0; i < max_batch; ++i) {
        inv[i] = -1;
        done[i] = 0;
    }
    for (int old = 0; old < old_batch; ++old) {
        const int dst = mapping[old];
        if (dst == -1) continue;
        if (dst < 0 || dst >= new_batch || inv[dst] != -1) {
            plan[HC_PLAN_STATUS] = 1;
            plan[HC_PLAN_BAD_INDEX] = old;
            return;
        }
        inv[dst] = old;
    }
    HcSchedule out = {sched, 0, 0, lengths};
    // Chains, each from its end: a destination whose own content nobody reads.
    for (int end = 0; end < max_batch; ++end) {
        if (inv[end] < 0 || inv[end] == end) continue;
        if (end < old_batch && mapping[end] != -1) continue;
        for (int cur = end; inv[cur] >= 0 && inv[cur] != cur && !done[cur]; cur = inv[cur]) {
            out.move(inv[cur], cur);
            done[cur] = 1;
        }
    }
    // What is left are cycles of length >= 2: park one slot in registers, rotate, unpark.
    for (int m = 0; m < old_batch; ++m) {
        const int dst = mapping[m];
        if (dst < 0 || dst == m || done[dst]) continue;
        out.move(m, HC_TMP);
        int cur = m;
        for (; inv[cur] != m; cur = inv[cur]) {
            out.move(inv[cur], cur);
            done[cur] = 1;
        }
        out.move(HC_TMP, cur);
        done[cur] = 1;
    }
    for (int j = 0; j < new_batch; ++j) {
        if (inv[j] == -1) out.move(HC_CLEAR, j);
    }
    const int n = out.count;
    const int max_len = out.max_len;
    plan[HC_PLAN_COUNT] = n;
    plan[HC_PLAN_MAX_LEN] = max_len;
    plan[HC_PLAN_STATUS] = 0;
}


#define HC_PLAN_NODES 1024  // the largest max_batch the block-wide build takes (shared memory)
#define HC_NONE 0x7fffffff

// Pointer jumping over the block's nodes (one per thread, x = threadIdx.x < n): `rounds` times,
// succ[x] <- succ[succ[x]] while val[x] <- op(val[x], val[succ[x]]). Every thread calls it.
template <bool MIN>
__device__ __forceinline__ void hc_jump(int* succ, int* val, int x, bool node, int rounds) {
    for (int r = 0; r < rounds; ++r) {
        int s = 0, v = 0;
        if (node) {
            const int y = succ[x];
            s = succ[y];
            v = MIN ? (val[x] < val[y] ? val[x] : val[y]) : val[x] + val[y];
        }
        __syncthreads();
        if (node) {
            succ[x] = s;
            val[x] = v;
        }
        __syncthreads();
    }
}

// Builds the schedule. Launch: grid (1), block (B, a multiple of 32, at most 1024); with
// max_batch <= B every slot has a thread and the build is block-wide (O(log max_batch) steps),
// else thread 0 builds it serially. Either way the plan's words are those of hc_plan_serial.
// mapping: int32 [old_batch]; lengths: int32 [max_batch] or null (then max length = 0).
//
// Block-wide: D, the slots that receive a move (inv[x] >= 0, inv[x] != x), splits into chains
// (their root: a slot whose content nobody needs, x >= old_batch or mapping[x] == -1) and
// cycles. Following mapping from x reaches x's chain root; pointer jumping finds each cycle's
// smallest slot m, then, with the cycles cut at m, each slot's rank (its distance to its root
// or m) and root. The serial schedule lists the chains by root, each from its root backwards
// (rank order), then the cycles by m ((m, TMP), then rank order, the last from TMP), then the
// clears by slot: one exclusive scan of these block sizes places every entry.
extern "C" __global__ void __launch_bounds__(1024) hc_compaction_plan(
    const int* __restrict__ mapping, int old_batch, int new_batch, int max_batch,
    const int* __restrict__ lengths, int* __restrict__ plan) {
    __shared__ int s_inv[HC_PLAN_NODES];
    __shared__ int s_succ[HC_PLAN_NODES];
    __shared__ int s_val[HC_PLAN_NODES];
    __shared__ int s_off[3 * HC_PLAN_NODES];
    __shared__ int s_part[1024];
    __shared__ int s_bad, s_max_len;
    if (blockIdx.x != 0) return;
    const int nt = (int)blockDim.x;
    const int x = (int)threadIdx.x;
    if (max_batch > nt || max_batch > HC_PLAN_NODES) {
        if (x == 0) hc_plan_serial(mapping, old_batch, new_batch, max_batch, lengths, plan);
        return;
    }
    if (x == 0) {
        plan[HC_PLAN_COUNT] = 0;
        plan[HC_PLAN_MAX_LEN] = 0;
        plan[HC_PLAN_BAD_INDEX] = -1;
    }
    if (max_batch < 0 || old_batch < 0 || old_batch > max_batch || new_batch < 0 ||
        new_batch > max_batch) {
        if (x == 0) plan[HC_PLAN_STATUS] = 2;
        return;
    }
    const int mb = max_batch;
    int* inv = plan + HC_PLAN_HEADER;
    int* done = inv + mb;
    int* sched = done + mb;
    const bool slot = x < mb;
    // inv by the smallest old index per destination; the first offending old index as the
    // serial loop meets it: the smallest old that is out of range or not first at its dst.
    if (slot) s_inv[x] = HC_NONE;
    for (int i = x; i < 3 * mb; i += nt) s_off[i] = 0;
    if (x == 0) {
        s_bad = HC_NONE;
        s_max_len = 0;
    }
    __syncthreads();
    const int dst = x < old_batch ? mapping[x] : -1;
    const bool in_range = dst >= 0 && dst < new_batch;
    if (x < old_batch && dst != -1 && !in_range) atomicMin(&s_bad, x);
    if (x < old_batch && in_range) atomicMin(&s_inv[dst], x);
    __syncthreads();
    if (x < old_batch && in_range && s_inv[dst] != x) atomicMin(&s_bad, x);
    __syncthreads();
    const int bad = s_bad;
    if (bad != HC_NONE) {  // as far as the serial loop got: the olds before the offender
        if (slot) {
            inv[x] = s_inv[x] < bad ? s_inv[x] : -1;
            done[x] = 0;
        }
        if (x == 0) {
            plan[HC_PLAN_BAD_INDEX] = bad;
            plan[HC_PLAN_STATUS] = 1;
        }
        return;
    }
    const int src = slot && s_inv[x] != HC_NONE ? s_inv[x] : -1;
    __syncthreads();
    if (slot) s_inv[x] = src;
    const bool node = src >= 0 && src != x;  // x in D
    const bool root = node && !in_range;     // x's content is not needed: a chain's root
    if (slot) {
        s_succ[x] = node && !root ? dst : x;
        s_val[x] = x;
    }
    int rounds = 0;
    while ((1 << rounds) < mb) ++rounds;
    __syncthreads();
    hc_jump<true>(s_succ, s_val, x, node, rounds);
    // a chain slot now points at its root; a cycle slot at a slot of its cycle
    bool cycle = false;
    int m = x;
    if (node) {
        const int y = s_succ[x];
        cycle = y < old_batch && mapping[y] >= 0 && mapping[y] != y;
        m = s_val[x];
    }
    __syncthreads();
    if (slot) {
        const bool stop = !node || root || (cycle && m == x);
        s_succ[x] = stop ? x : dst;
        s_val[x] = stop ? 0 : 1;
    }
    __syncthreads();
    hc_jump<false>(s_succ, s_val, x, node, rounds);
    const int top = node ? s_succ[x] : x;
    const int rank = node ? s_val[x] : 0;
    if (node) {
        if (cycle) atomicMax(&s_off[mb + top], rank + 2);
        else atomicMax(&s_off[top], rank + 1);
        if (lengths != nullptr) atomicMax(&s_max_len, lengths[src]);
    }
    if (x < new_batch && src == -1) s_off[2 * mb + x] = 1;
    __syncthreads();
    // exclusive scan of the 3 mb block sizes: contiguous items per thread, then the threads
    const int per = (3 * mb + nt - 1) / nt;
    const int lo = x * per < 3 * mb ? x * per : 3 * mb;
    const int hi = lo + per < 3 * mb ? lo + per : 3 * mb;
    int sum = 0;
    for (int i = lo; i < hi; ++i) sum += s_off[i];
    s_part[x] = sum;
    __syncthreads();
    for (int d = 1; d < nt; d <<= 1) {
        const int add = x >= d ? s_part[x - d] : 0;
        __syncthreads();
        s_part[x] += add;
        __syncthreads();
    }
    int run = x > 0 ? s_part[x - 1] : 0;
    for (int i = lo; i < hi; ++i) {
        const int size = s_off[i];
        s_off[i] = run;
        run += size;
    }
    const int total = s_part[nt - 1];
    __syncthreads();
    if (node && !cycle) {
        const int e = s_off[top] + rank;
        sched[2 * e] = src;
        sched[2 * e + 1] = x;
    } else if (node) {
        const int base = s_off[mb + top];
        if (x == top) {
            sched[2 * base] = x;
            sched[2 * base + 1] = HC_TMP;
        }
        const int e = base + 1 + rank;
        sched[2 * e] = src == top ? HC_TMP : src;
        sched[2 * e + 1] = x;
    }
    if (x < new_batch && src == -1) {
        const int e = s_off[2 * mb + x];
        sched[2 * e] = HC_CLEAR;
        sched[2 * e + 1] = x;
    }
    if (slot) {
        inv[x] = src;
        done[x] = node ? 1 : 0;
    }
    __syncthreads();
    if (x == 0) {
        plan[HC_PLAN_COUNT] = total;
        plan[HC_PLAN_MAX_LEN] = s_max_len;
        plan[HC_PLAN_STATUS] = 0;
    }
}

__device__ __forceinline__ hc_i64 hc_span_bytes(int len, int cap, int row_bytes) {
    const int l = len < 0 ? 0 : (len > cap ? cap : len);
    return (hc_i64)l * row_bytes;
}

// Chunks a thread holds at once: a block takes a tile of HC_COMPACT_IN_FLIGHT * blockDim chunks
// of the span (thread j: chunks j, j + blockDim, ...), walks the schedule once per tile,
// resolving each entry's slots and span once, and per entry loads all of its chunks before its
// first store. A byte offset belongs to one thread in every slot, so program order still orders
// each move's reads after the earlier moves' writes (the plan's chains and cycles).
#define HC_COMPACT_IN_FLIGHT 4

// The chunk offsets of one thread's tile: first, first + stride, ... (stride = blockDim * W).
struct HcTile {
    hc_i64 first;
    hc_i64 stride;
};

template <int W>
__device__ __forceinline__ void hc_tile_load(HcChunk* buf, const char* src, HcTile t, hc_i64 n) {
    const hc_i64 left = n - t.first;  // bytes of the span from the thread's first chunk on
#pragma unroll
    for (int u = 0; u < HC_COMPACT_IN_FLIGHT; ++u) {
        const hc_i64 at = u * t.stride;
        if (at < left) hc_load_chunk<W>(buf[u], src + t.first, at, left);
    }
}

template <int W>
__device__ __forceinline__ void hc_tile_store(char* dst, const HcChunk* buf, HcTile t, hc_i64 n) {
    const hc_i64 left = n - t.first;  // bytes of the span from the thread's first chunk on
#pragma unroll
    for (int u = 0; u < HC_COMPACT_IN_FLIGHT; ++u) {
        const hc_i64 at = u * t.stride;
        if (at < left) hc_store_chunk<W>(dst + t.first, buf[u], at, left);
    }
}

template <int W>
__device__ __forceinline__ void hc_tile_zero(char* dst, HcTile t, hc_i64 n) {
    const hc_i64 left = n - t.first;  // bytes of the span from the thread's first chunk on
#pragma unroll
    for (int u = 0; u < HC_COMPACT_IN_FLIGHT; ++u) {
        const hc_i64 at = u * t.stride;
        if (at < left) hc_zero_chunk<W>(dst + t.first, at, left);
    }
}

// The bytes of one block's tile; tile k of a span starts at byte k * hc_tile_bytes<W>().
template <int W>
__device__ __forceinline__ hc_i64 hc_tile_bytes() {
    return (hc_i64)HC_COMPACT_IN_FLIGHT * blockDim.x * W;
}

template <int W>
__device__ void hc_kv_compact_body(char* base, hc_i64 slot_stride,
                                   const int* sched, int count, const int* lengths, int cap,
                                   int row_bytes, int num_slots, hc_i64 span_limit) {
    const hc_i64 tile = hc_tile_bytes<W>();
    for (hc_i64 start = blockIdx.z * tile; start < span_limit; start += gridDim.z * tile) {
        const HcTile t = {start + (hc_i64)threadIdx.x * W, (hc_i64)blockDim.x * W};
        HcChunk tmp[HC_COMPACT_IN_FLIGHT];
        HcChunk buf[HC_COMPACT_IN_FLIGHT];
#pragma unroll
        for (int u = 0; u < HC_COMPACT_IN_FLIGHT; ++u) tmp[u] = HcChunk{0u, 0u, 0u, 0u};
        hc_i64 tmp_n = 0;
        if (t.first >= span_limit) break;  // a thread past the span's end (its last tile)
        for (int e = 0; e < count; ++e) {
            const int src = sched[2 * e];
            const int dst = sched[2 * e + 1];
            if (dst == HC_TMP) {
                if (src < 0 || src >= num_slots) continue;
                tmp_n = hc_span_bytes(lengths[src], cap, row_bytes);
                if (tmp_n > span_limit) tmp_n = span_limit;
                hc_tile_load<W>(tmp, base + src * slot_stride, t, tmp_n);
            } else if (src == HC_TMP) {
                if (dst < 0 || dst >= num_slots) continue;
                hc_tile_store<W>(base + dst * slot_stride, tmp, t, tmp_n);
            } else if (src >= 0 && src < num_slots && dst >= 0 && dst < num_slots) {
                hc_i64 n = hc_span_bytes(lengths[src], cap, row_bytes);
                if (n > span_limit) n = span_limit;
                if (t.first >= n) continue;  // nothing of this span in the thread's chunks
                hc_tile_load<W>(buf, base + src * slot_stride, t, n);
                hc_tile_store<W>(base + dst * slot_stride, buf, t, n);
            }
        }
    }
}

// Moves the first lengths[old] tokens of every kept slot, for every layer of a head-dim group,
// none at or past the plan's max length (span_limit: the bytes no chunk may pass). Spans are
// clamped to the layer's max_seq_len, so a ring layer (ring_window > 0) moves the
// min(lengths[old], W) entries it holds, each to the same ring entry (lengths are absolute).
// layers: KVLayerInfo [num_layers], each cache [num_slots, C, H_l, S_l, D] with C = components
// (2: K and V, 1: a latent cache) and D*itemsize == row_bytes; lengths: int32 [num_slots], read
// before any length is compacted.
// Launch: grid (C * max_kv_heads, num_layers, z), block (B); blocks past a layer's heads exit.
extern "C" __global__ void hc_kv_compact(const KVLayerInfo* __restrict__ layers,
                                         const int* __restrict__ plan, int max_batch,
                                         const int* __restrict__ lengths, int components,
                                         int row_bytes, int num_slots) {
    if (plan[HC_PLAN_STATUS] != 0) return;
    const KVLayerInfo info = layers[blockIdx.y];
    const int kvh = blockIdx.x;  // kv * H + head
    if (kvh >= components * info.num_kv_heads) return;
    const hc_i64 head_span = (hc_i64)info.max_seq_len * row_bytes;
    const hc_i64 slot_stride = components * (hc_i64)info.num_kv_heads * head_span;
    char* base = reinterpret_cast<char*>(info.data) + kvh * head_span;
    const int w = hc_vec_width(info.data | (hc_u64)head_span | (hc_u64)slot_stride);
    const hc_i64 limit = hc_span_bytes(plan[HC_PLAN_MAX_LEN], info.max_seq_len, row_bytes);
    const int* sched = hc_plan_schedule(plan, max_batch);
    const int count = hc_plan_count(plan, max_batch);
    HC_DISPATCH_WIDTH(w, hc_kv_compact_body, base, slot_stride, sched, count,
                      lengths, info.max_seq_len, row_bytes, num_slots, limit);
}

template <int W>
__device__ void hc_slots_compact_body(char* base, hc_i64 slot_bytes, const int* sched, int count,
                                      int num_slots) {
    const hc_i64 tile = hc_tile_bytes<W>();
    for (hc_i64 start = blockIdx.x * tile; start < slot_bytes; start += gridDim.x * tile) {
        const HcTile t = {start + (hc_i64)threadIdx.x * W, (hc_i64)blockDim.x * W};
        HcChunk tmp[HC_COMPACT_IN_FLIGHT];
        HcChunk buf[HC_COMPACT_IN_FLIGHT];
#pragma unroll
        for (int u = 0; u < HC_COMPACT_IN_FLIGHT; ++u) tmp[u] = HcChunk{0u, 0u, 0u, 0u};
        if (t.first >= slot_bytes) break;  // a thread past the slot's end (its last tile)
        for (int e = 0; e < count; ++e) {
            const int src = sched[2 * e];
            const int dst = sched[2 * e + 1];
            if (dst == HC_TMP) {
                if (src >= 0 && src < num_slots)
                    hc_tile_load<W>(tmp, base + src * slot_bytes, t, slot_bytes);
            } else if (dst < 0 || dst >= num_slots) {
                continue;
            } else if (src == HC_TMP) {
                hc_tile_store<W>(base + dst * slot_bytes, tmp, t, slot_bytes);
            } else if (src == HC_CLEAR) {
                hc_tile_zero<W>(base + dst * slot_bytes, t, slot_bytes);
            } else if (src >= 0 && src < num_slots) {
                hc_tile_load<W>(buf, base + src * slot_bytes, t, slot_bytes);
                hc_tile_store<W>(base + dst * slot_bytes, buf, t, slot_bytes);
            }
        }
    }
}

// Moves whole slots of a set of tensors (all Mamba recurrent and conv states, and the lengths
// array) by the plan; slots below new_batch that receive nothing are zeroed.
// tensors: SlotTensorInfo [num_tensors] with src == dst; the slot count is min(src_slots,
// dst_slots). Launch: grid (x, num_tensors), block (B).
extern "C" __global__ void hc_slots_compact(const SlotTensorInfo* __restrict__ tensors,
                                            const int* __restrict__ plan, int max_batch) {
    if (plan[HC_PLAN_STATUS] != 0) return;
    const SlotTensorInfo t = tensors[blockIdx.y];
    const int num_slots = t.src_slots < t.dst_slots ? t.src_slots : t.dst_slots;
    const int w = hc_vec_width(t.dst | (hc_u64)t.slot_bytes);
    HC_DISPATCH_WIDTH(w, hc_slots_compact_body, reinterpret_cast<char*>(t.dst), t.slot_bytes,
                      hc_plan_schedule(plan, max_batch), hc_plan_count(plan, max_batch),
                      num_slots);
}

// Exported: hc_compaction_plan, hc_kv_compact, hc_slots_compact
