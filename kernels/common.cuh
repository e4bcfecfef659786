// hcache kernels: shared types and the chunked byte-copy used by every family.
//
// Every kernel moves bytes, never interprets elements, so one instance serves all seven dtypes.
// A copy is split into chunks of W bytes (W = 16, 8, 4, 2 or 1: the largest power of two that
// divides every span start of the launch, so W = 16 gives 16-byte vector loads and stores). The
// last chunk of a span may be short; it is copied byte by byte (the scalar tail).
//
// Invariant used by the in-place compaction: chunk c of a span is always handled by the same
// thread, whichever slot the span belongs to, because W depends only on the launch's base
// addresses and strides, never on the slot.
//
// No host headers: this compiles under NVRTC and, through tests/cuda_emu.h, under g++.
#pragma once

typedef unsigned long long hc_u64;
typedef long long hc_i64;

// One attention layer of a head-dim group, as seen by a multi-layer kernel (16 bytes).
// data: layer base address; layout [num_slots, 2, num_kv_heads, max_seq_len, head_dim]
// unless a kernel says otherwise (a paged pool uses max_seq_len = block size).
struct KVLayerInfo {
    hc_u64 data;
    int num_kv_heads;
    int max_seq_len;
};

// One tensor of a slot set: slot i of src is src + i*slot_bytes (likewise dst).
struct SlotTensorInfo {
    hc_u64 src;
    hc_u64 dst;
    hc_i64 slot_bytes;
    int src_slots;
    int dst_slots;
};

// New K and V rows of one layer for a write: [num_tokens, num_kv_heads, head_dim] each.
struct KVSrcInfo {
    hc_u64 k;
    hc_u64 v;
};

// The largest power of two, at most 16, that divides x.
__device__ __forceinline__ int hc_vec_width(hc_u64 x) {
    x |= 16ull;
    return (int)(x & (~x + 1ull));
}

template <int W> struct HcVec;
template <> struct HcVec<16> { typedef uint4 T; };
template <> struct HcVec<8> { typedef uint2 T; };
template <> struct HcVec<4> { typedef unsigned int T; };
template <> struct HcVec<2> { typedef unsigned short T; };
template <> struct HcVec<1> { typedef unsigned char T; };

// A chunk held in registers (the compaction's one-slot temporary).
union HcChunk {
    uint4 v16;
    unsigned char b[16];
};

// Copy bytes [off, min(off + W, n)) of a span; off is a multiple of W and off < n.
template <int W>
__device__ __forceinline__ void hc_copy_chunk(char* dst, const char* src, hc_i64 off, hc_i64 n) {
    typedef typename HcVec<W>::T V;
    if (off + W <= n) {
        *reinterpret_cast<V*>(dst + off) = *reinterpret_cast<const V*>(src + off);
    } else {
        for (hc_i64 i = off; i < n; ++i) dst[i] = src[i];
    }
}

template <int W>
__device__ __forceinline__ void hc_load_chunk(HcChunk& c, const char* src, hc_i64 off, hc_i64 n) {
    typedef typename HcVec<W>::T V;
    if (off + W <= n) {
        *reinterpret_cast<V*>(c.b) = *reinterpret_cast<const V*>(src + off);
    } else {
        for (hc_i64 i = off; i < n; ++i) c.b[i - off] = (unsigned char)src[i];
    }
}

template <int W>
__device__ __forceinline__ void hc_store_chunk(char* dst, const HcChunk& c, hc_i64 off, hc_i64 n) {
    typedef typename HcVec<W>::T V;
    if (off + W <= n) {
        *reinterpret_cast<V*>(dst + off) = *reinterpret_cast<const V*>(c.b);
    } else {
        for (hc_i64 i = off; i < n; ++i) dst[i] = (char)c.b[i - off];
    }
}

template <int W>
__device__ __forceinline__ void hc_zero_chunk(char* dst, hc_i64 off, hc_i64 n) {
    typedef typename HcVec<W>::T V;
    if (off + W <= n) {
        V z;
        unsigned char* zb = reinterpret_cast<unsigned char*>(&z);
        for (int i = 0; i < W; ++i) zb[i] = 0;
        *reinterpret_cast<V*>(dst + off) = z;
    } else {
        for (hc_i64 i = off; i < n; ++i) dst[i] = 0;
    }
}

// Calls BODY<W>(args...) with W the runtime width w (one of 16, 8, 4, 2, 1).
#define HC_DISPATCH_WIDTH(w, BODY, ...)                     \
    switch (w) {                                            \
        case 16: BODY<16>(__VA_ARGS__); break;              \
        case 8: BODY<8>(__VA_ARGS__); break;                \
        case 4: BODY<4>(__VA_ARGS__); break;                \
        case 2: BODY<2>(__VA_ARGS__); break;                \
        default: BODY<1>(__VA_ARGS__); break;               \
    }

// Counts an out-of-range index that a kernel skipped (status may be null).
__device__ __forceinline__ void hc_report(int* status) {
    if (status != nullptr) atomicAdd(status, 1);
}
