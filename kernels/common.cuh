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

// One attention layer of a head-dim group, as seen by a multi-layer kernel (24 bytes).
// data: layer base address; layout [num_slots, C, num_kv_heads, max_seq_len, head_dim] unless a
// kernel says otherwise (a paged pool uses max_seq_len = block size). C, the components, is a
// launch argument shared by the group: 2 (K then V) or 1 (a latent MLA cache).
// ring_window: 0 for an unbounded layer; W > 0 for a ring buffer of a sliding-window layer,
// whose max_seq_len is W: absolute position p lives at p mod max_seq_len (the kernels take the
// modulus by max_seq_len, so a wrong ring_window can never address outside the buffer).
struct KVLayerInfo {
    hc_u64 data;
    int num_kv_heads;
    int max_seq_len;
    int ring_window;
    int reserved;
};

// One tensor of a slot set: slot i of src is src + i*slot_bytes (likewise dst).
struct SlotTensorInfo {
    hc_u64 src;
    hc_u64 dst;
    hc_i64 slot_bytes;
    int src_slots;
    int dst_slots;
};

// New K and V rows of one layer for a write: [num_tokens, num_kv_heads, head_dim] each (v is
// not read, and may be null, when the group has one component).
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

// A chunk held in registers (the compaction's one-slot temporary). Bytes are reached by shifts,
// never by a runtime array index, so the chunk never spills to local memory.
typedef uint4 HcChunk;

__device__ __forceinline__ unsigned int hc_byte(const HcChunk& c, int j) {
    const unsigned int w = j < 8 ? (j < 4 ? c.x : c.y) : (j < 12 ? c.z : c.w);
    return (w >> ((j & 3) * 8)) & 0xffu;
}

__device__ __forceinline__ void hc_set_byte(HcChunk& c, int j, unsigned int b) {
    const int shift = (j & 3) * 8;
    const unsigned int keep = ~(0xffu << shift);
    b <<= shift;
    if (j < 4) c.x = (c.x & keep) | b;
    else if (j < 8) c.y = (c.y & keep) | b;
    else if (j < 12) c.z = (c.z & keep) | b;
    else c.w = (c.w & keep) | b;
}

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
        *reinterpret_cast<V*>(&c) = *reinterpret_cast<const V*>(src + off);
    } else {
        for (int j = 0; j < (int)(n - off); ++j)
            hc_set_byte(c, j, (unsigned char)src[off + j]);
    }
}

template <int W>
__device__ __forceinline__ void hc_store_chunk(char* dst, const HcChunk& c, hc_i64 off, hc_i64 n) {
    typedef typename HcVec<W>::T V;
    if (off + W <= n) {
        *reinterpret_cast<V*>(dst + off) = *reinterpret_cast<const V*>(&c);
    } else {
        for (int j = 0; j < (int)(n - off); ++j) dst[off + j] = (char)hc_byte(c, j);
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

// Flat work indices fit in 32 bits when the whole grid-stride loop does (bound + one stride);
// then the index arithmetic (a few divisions per chunk) uses 32-bit integers, which is several
// times cheaper than 64-bit division on a GPU.
__device__ __forceinline__ bool hc_fits_u32(hc_u64 bound) {
#ifdef HC_FORCE_U64_INDEX  // tests: run the 64-bit index path on small shapes too
    (void)bound;
    return false;
#else
    return bound + (hc_u64)gridDim.x * blockDim.x < 0xffffffffull;
#endif
}

// Counts an out-of-range index that a kernel skipped (status may be null).
__device__ __forceinline__ void hc_report(int* status) {
    if (status != nullptr) atomicAdd(status, 1);
}
