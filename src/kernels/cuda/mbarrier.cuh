/* Shared-memory mbarriers of the warp-specialised kernels (PTX ISA "Parallel Synchronization and
 * Communication Instructions: mbarrier", sm_90): a producer fills a ring slot and the slot's "full"
 * barrier completes; consumers wait on it, use the slot and arrive on its "empty" barrier. bar: the
 * barrier's shared-memory address (8 bytes, 8-byte aligned); parity: the phase waited for (0, 1, 0,
 * ... as the slot is reused). */
#ifndef FP4MOE_KERNELS_CUDA_MBARRIER_CUH
#define FP4MOE_KERNELS_CUDA_MBARRIER_CUH

#include <stdint.h>

/* count: the arrivals that complete a phase */
__device__ __forceinline__ void cu_mbar_init(uint32_t bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
/* spins until the phase of `parity` has completed (acquire) */
__device__ __forceinline__ void cu_mbar_wait(uint32_t bar, int parity) {
    asm volatile("{\n.reg .pred P1;\nCU_MBAR_WAIT:\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 P1, [%0], %1;\n"
                 "@!P1 bra CU_MBAR_WAIT;\n}\n" ::"r"(bar), "r"(parity) : "memory");
}
/* one arrival (release) */
__device__ __forceinline__ void cu_mbar_arrive(uint32_t bar) {
    asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(bar) : "memory");
}
/* one arrival once this thread's cp.async copies issued so far have landed (counted in `count`) */
__device__ __forceinline__ void cu_mbar_arrive_cp_async(uint32_t bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}

#endif
