// A small CUDA emulation header: lets g++ compile an unchanged kernels/*.cu file and run its
// kernels on the CPU, one block and one thread at a time (tests only).
//
// Supported: __global__/__device__ functions, threadIdx/blockIdx/blockDim/gridDim, uint4/uint2,
// atomicAdd on int, __ldg, __float_as_uint / __uint_as_float, __fdiv_rn, #pragma unroll
// (ignored: emu.py passes -Wno-unknown-pragmas). Not supported, and refused at compile time:
// __syncthreads, warp shuffles, __shared__ memory (the hcache kernels use none: every thread
// only depends on its own chunks, which is what makes serial execution faithful).
#pragma once
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <utility>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __restrict__ __restrict
#define __shared__ static_assert(false, "cuda_emu: __shared__ is not supported");
#define __syncthreads() static_assert(false, "cuda_emu: __syncthreads is not supported")

struct alignas(16) uint4 { unsigned int x, y, z, w; };
struct alignas(8) uint2 { unsigned int x, y; };
struct dim3 {
    unsigned int x = 1, y = 1, z = 1;
};
typedef dim3 uint3;

inline thread_local dim3 threadIdx, blockIdx, blockDim, gridDim;

inline int atomicAdd(int* p, int v) { return std::atomic_ref<int>(*p).fetch_add(v); }
template <typename T> inline T __ldg(const T* p) { return *p; }

// Bit casts and the IEEE round-to-nearest division (SSE on x86-64, like the GPU's div.rn.f32;
// the flags keep g++ from contracting or reassociating it).
inline unsigned int __float_as_uint(float x) {
    unsigned int u;
    std::memcpy(&u, &x, sizeof u);
    return u;
}
inline float __uint_as_float(unsigned int u) {
    float x;
    std::memcpy(&x, &u, sizeof x);
    return x;
}
inline float __fdiv_rn(float a, float b) { return a / b; }

namespace cuda_emu {

template <typename... A, std::size_t... I>
inline void call(void (*k)(A...), void** args, std::index_sequence<I...>) {
    k(*static_cast<std::remove_reference_t<A>*>(args[I])...);
}

inline dim3 unflatten(unsigned long long i, dim3 d) {
    return dim3{unsigned(i % d.x), unsigned(i / d.x % d.y), unsigned(i / d.x / d.y)};
}

// Runs kernel k over the whole grid, serially, each thread to completion: blocks and threads
// in x-fastest order, or all of them in the reverse order when `reverse` is set. A correct
// kernel of this package gives the same bytes either way (no thread reads what another writes);
// one that relies on a cross-thread ordering fails one of the two orders.
template <typename... A>
inline void launch(void (*k)(A...), dim3 grid, dim3 block, int reverse, void** args) {
    gridDim = grid;
    blockDim = block;
    const unsigned long long nb = 1ull * grid.x * grid.y * grid.z;
    const unsigned long long nt = 1ull * block.x * block.y * block.z;
    for (unsigned long long b = 0; b < nb; ++b) {
        blockIdx = unflatten(reverse ? nb - 1 - b : b, grid);
        for (unsigned long long t = 0; t < nt; ++t) {
            threadIdx = unflatten(reverse ? nt - 1 - t : t, block);
            call(k, args, std::index_sequence_for<A...>{});
        }
    }
}

}  // namespace cuda_emu

// Exports an entry point "emu_<name>" taking cuLaunchKernel-style arguments.
#define CUDA_EMU_EXPORT(name)                                                                \
    extern "C" void emu_##name(unsigned gx, unsigned gy, unsigned gz, unsigned bx,           \
                               unsigned by, unsigned bz, int reverse, void** args) {         \
        cuda_emu::launch(name, dim3{gx, gy, gz}, dim3{bx, by, bz}, reverse, args);           \
    }
