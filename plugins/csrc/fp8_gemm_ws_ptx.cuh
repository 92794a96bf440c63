// DSA-TRT kernels: the PTX wrappers of the warp-specialised fp8 GEMM (fp8_gemm_ws.cuh): mbarriers on
// shared addresses, TMA loads / stores / multicast, cluster barriers. sm_90a.
#pragma once

#include <cuda.h>  // CUtensorMap
#include <stdint.h>

#include "ptx.cuh"

namespace dsa_fp8_ws {

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
// Blocks until the phase of parity `parity` completed (acquire: the TMA-written bytes are visible).
// kSleep adds a suspend-time hint: ptxas then puts NANOSLEEP.SYNCS in the retry path, so a waiting
// thread sleeps until the barrier changes (or 50 us pass) instead of spinning in issue slots that
// the consumer warps of its SM sub-partition need (cuBLASLt's GEMM waits this way).
#define DSA_WS_WAIT_ASM(HINT)                                            \
  "{\n"                                                                  \
  ".reg .pred P1;\n"                                                     \
  "WS_WAIT:\n"                                                           \
  "mbarrier.try_wait.parity.shared::cta.b64 P1, [%0], %1" HINT ";\n"     \
  "@P1 bra WS_DONE;\n"                                                   \
  "bra WS_WAIT;\n"                                                       \
  "WS_DONE:\n"                                                           \
  "}\n"
template <bool kSleep = false>
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  if constexpr (kSleep)
    asm volatile(DSA_WS_WAIT_ASM(", 50000")::"r"(bar), "r"(parity) : "memory");
  else
    asm volatile(DSA_WS_WAIT_ASM("")::"r"(bar), "r"(parity) : "memory");
}
#undef DSA_WS_WAIT_ASM
// 2-D tensor tile (c0 inner, c1 outer) -> shared memory, completing on `bar`'s transaction count.
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap* map, uint32_t bar, int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];" ::"r"(
          dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1)
      : "memory");
}
// The same box into the shared memory of every CTA in `mask` of the cluster (same offset), each
// completing on its own barrier at `bar`'s offset.
__device__ __forceinline__ void tma_load_2d_multicast(uint32_t dst, const CUtensorMap* map, uint32_t bar, int c0,
                                                      int c1, uint16_t mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1, {%3, "
      "%4}], [%2], %5;" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1), "h"(mask)
      : "memory");
}
// Shared memory -> a 2-D tensor box (c0 inner, c1 outer), clipped at the tensor's bounds, in this
// thread's bulk group; the writes before it reach the async proxy through fence_proxy_async.
__device__ __forceinline__ void tma_store_2d(const CUtensorMap* map, uint32_t src, int c0, int c1) {
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(src), "r"(c0), "r"(c1)
               : "memory");
}
__device__ __forceinline__ void tma_store_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
// This thread's bulk groups have read their shared memory (it may be rewritten).
__device__ __forceinline__ void tma_store_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); }
// This thread's bulk groups have completed.
__device__ __forceinline__ void tma_store_wait() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }
// Arrive on the barrier at `bar`'s offset in cluster CTA `rank`, with the default release.cta
// semantics. release.cluster compiles to MEMBAR.ALL.GPU before every arrive: once per K block
// and peer in each consumer warp, it was the largest stall of the prefill tiles (ncu on the H200:
// 4.8 of 13.8 cycles per issued instruction waiting on a memory barrier). The stage's readers
// are done before the arrive (wgmma_wait, and the token scales already in registers), and a
// peer only refills the stage with TMA, which waits for this phase: no cluster-scope fence needed.
__device__ __forceinline__ void mbar_arrive_cluster(uint32_t bar, uint32_t rank) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(bar), "r"(rank));
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];" ::"r"(remote) : "memory");
}
__device__ __forceinline__ uint32_t cluster_ctarank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
// Every thread of every CTA of the cluster (release / acquire: barrier inits, remote arrivals).
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;" ::: "memory");
}
__device__ __forceinline__ void tma_prefetch_desc(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

}  // namespace dsa_fp8_ws
