// A small CUDA emulation header: lets g++ compile an unchanged kernels/*.cu file and run its
// kernels on the CPU, one block and one thread at a time (tests only).
//
// Supported: __global__/__device__ functions, threadIdx/blockIdx/blockDim/gridDim, uint4/uint2,
// atomicAdd on int, __ldg. Not supported, and refused at compile time: __syncthreads, warp
// shuffles, __shared__ memory (the hcache kernels use none: every thread only depends on its own
// chunks, which is what makes serial execution faithful).
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

namespace cuda_emu {

template <typename... A, std::size_t... I>
inline void call(void (*k)(A...), void** args, std::index_sequence<I...>) {
    k(*static_cast<std::remove_reference_t<A>*>(args[I])...);
}

// Runs kernel k over the whole grid, serially: blocks in x-fastest order, threads likewise.
template <typename... A>
inline void launch(void (*k)(A...), dim3 grid, dim3 block, void** args) {
    gridDim = grid;
    blockDim = block;
    for (unsigned bz = 0; bz < grid.z; ++bz)
        for (unsigned by = 0; by < grid.y; ++by)
            for (unsigned bx = 0; bx < grid.x; ++bx) {
                blockIdx = dim3{bx, by, bz};
                for (unsigned tz = 0; tz < block.z; ++tz)
                    for (unsigned ty = 0; ty < block.y; ++ty)
                        for (unsigned tx = 0; tx < block.x; ++tx) {
                            threadIdx = dim3{tx, ty, tz};
                            call(k, args, std::index_sequence_for<A...>{});
                        }
            }
}

}  // namespace cuda_emu

// Exports an entry point "emu_<name>" taking cuLaunchKernel-style arguments.
#define CUDA_EMU_EXPORT(name)                                                                \
    extern "C" void emu_##name(unsigned gx, unsigned gy, unsigned gz, unsigned bx,           \
                               unsigned by, unsigned bz, void** args) {                      \
        cuda_emu::launch(name, dim3{gx, gy, gz}, dim3{bx, by, bz}, args);                    \
    }
