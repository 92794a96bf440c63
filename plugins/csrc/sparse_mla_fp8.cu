// DSA-TRT sparse MLA, fp8 pool, unsplit: instantiations of the wgmma kernel (sparse_mla_fp8.cuh)
// for the four head counts: 16, 32, 64 real heads in one 64-row block, or two full blocks (128).
// One CTA per (token, head block) writes bf16 out + lse directly. The split-KV variant for small T
// is sparse_mla_fp8_split.cu.
#include "common.cuh"
#include "sparse_mla.cuh"
#include "sparse_mla_fp8.cuh"

namespace dsa_sparse_mla {

int launch_fp8(const DsaSparseMlaParams& p, cudaStream_t stream) {
  const SplitPlan whole{1, (p.topk + kTileKeys - 1) / kTileKeys, nullptr, nullptr};  // unused by the kernel
  switch (p.num_heads) {  // real heads in the 64-row block
    case 16: return launch_kernel<16, 1, false>(p, whole, stream);
    case 32: return launch_kernel<32, 1, false>(p, whole, stream);
    case 64: return launch_kernel<64, 1, false>(p, whole, stream);
    case 128: return launch_kernel<64, 2, false>(p, whole, stream);
    default: break;
  }
  return dsa_set_error(DSA_ERR_UNSUPPORTED, "sparse_mla: num_heads=%d unsupported (16, 32, 64, 128)", p.num_heads);
}

}  // namespace dsa_sparse_mla
