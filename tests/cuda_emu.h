// A small CUDA emulation header: lets g++ compile an unchanged kernels/*.cu file and run its
// kernels on the CPU, one block at a time (tests only).
//
// Supported: __global__/__device__ functions, __launch_bounds__ (ignored), threadIdx/blockIdx/
// blockDim/gridDim, uint4/uint2, atomicAdd/atomicMin/atomicMax on int, __ldg,
// __float_as_uint / __uint_as_float, __fdiv_rn, #pragma unroll (ignored: emu.py passes
// -Wno-unknown-pragmas), and, in a family compiled with CUDA_EMU_BARRIERS (emu.py defines it
// for a .cu that calls __syncthreads), __shared__ memory and __syncthreads: each thread of a
// block is then a coroutine (ucontext) that runs until it reaches a barrier or returns, and the
// block's threads resume together once every live one waits at the barrier. A barrier that some
// threads of a block skip (they returned first) aborts, as it hangs or is undefined on a GPU.
// Without CUDA_EMU_BARRIERS each thread runs to completion in turn, and __shared__ /
// __syncthreads are refused at compile time. Not supported: warp shuffles and votes.
#pragma once
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <utility>
#ifdef CUDA_EMU_BARRIERS
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <ucontext.h>
#include <vector>
#endif

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __restrict__ __restrict
#ifdef CUDA_EMU_BARRIERS
// One block runs at a time, all its threads on one OS thread: a function-local static is the
// block's shared memory.
#define __shared__ static
#define __syncthreads() cuda_emu::barrier()
#else
#define __shared__ static_assert(false, "cuda_emu: __shared__ needs CUDA_EMU_BARRIERS");
#define __syncthreads() static_assert(false, "cuda_emu: __syncthreads needs CUDA_EMU_BARRIERS")
#endif

struct alignas(16) uint4 { unsigned int x, y, z, w; };
struct alignas(8) uint2 { unsigned int x, y; };
struct dim3 {
    unsigned int x = 1, y = 1, z = 1;
};
typedef dim3 uint3;

inline thread_local dim3 threadIdx, blockIdx, blockDim, gridDim;

inline int atomicAdd(int* p, int v) { return std::atomic_ref<int>(*p).fetch_add(v); }
inline int atomicMin(int* p, int v) {
    const int old = *p;
    if (v < old) *p = v;
    return old;
}
inline int atomicMax(int* p, int v) {
    const int old = *p;
    if (v > old) *p = v;
    return old;
}
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

#ifdef CUDA_EMU_BARRIERS
// The block's threads as coroutines: `self` is the one running (null: the scheduler runs).
struct Fiber {
    ucontext_t ctx;
    dim3 tid;
    bool done = false;
    std::unique_ptr<char[]> stack;
};
inline thread_local ucontext_t scheduler;
inline thread_local Fiber* self = nullptr;
inline thread_local void (*fiber_body)(void*) = nullptr;
inline thread_local void* fiber_arg = nullptr;

inline void barrier() {
    if (self == nullptr) {
        std::fputs("cuda_emu: __syncthreads outside a kernel\n", stderr);
        std::abort();
    }
    swapcontext(&self->ctx, &scheduler);
}

inline void fiber_main() {
    fiber_body(fiber_arg);
    self->done = true;  // returning resumes uc_link: the scheduler
}

// Runs one block: every live thread up to its next barrier (in thread order, or reversed),
// then again, until all have returned.
inline void run_block(dim3 block, int reverse, void (*body)(void*), void* arg) {
    const unsigned long long nt = 1ull * block.x * block.y * block.z;
    constexpr std::size_t kStack = 64 * 1024;
    std::vector<Fiber> fibers(nt);
    fiber_body = body;
    fiber_arg = arg;
    for (unsigned long long t = 0; t < nt; ++t) {
        Fiber& f = fibers[t];
        f.tid = unflatten(t, block);
        f.stack.reset(new char[kStack]);
        getcontext(&f.ctx);
        f.ctx.uc_stack.ss_sp = f.stack.get();
        f.ctx.uc_stack.ss_size = kStack;
        f.ctx.uc_link = &scheduler;
        makecontext(&f.ctx, fiber_main, 0);
    }
    for (;;) {
        unsigned long long live = 0, finished = 0;
        for (unsigned long long i = 0; i < nt; ++i) {
            Fiber& f = fibers[reverse ? nt - 1 - i : i];
            if (f.done) continue;
            ++live;
            threadIdx = f.tid;
            self = &f;
            swapcontext(&scheduler, &f.ctx);
            self = nullptr;
            finished += f.done;
        }
        if (live == 0) return;
        if (finished != 0 && finished != live) {
            std::fputs("cuda_emu: a barrier that some threads of the block never reach\n",
                       stderr);
            std::abort();
        }
    }
}
#endif

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
#ifdef CUDA_EMU_BARRIERS
        struct Call {
            void (*k)(A...);
            void** args;
        } call_args{k, args};
        run_block(block, reverse, [](void* p) {
            Call* c = static_cast<Call*>(p);
            call(c->k, c->args, std::index_sequence_for<A...>{});
        }, &call_args);
        continue;
#endif
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
