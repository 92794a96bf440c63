// DSA-TRT sparse MLA, fp8 pool: instantiations of the wgmma kernel (sparse_mla_fp8.cuh) for the
// four head counts: 16, 32, 64 real heads in one 64-row block, or two full blocks (128).
#include <atomic>

#include "common.cuh"
#include "sparse_mla.cuh"
#include "sparse_mla_fp8.cuh"

namespace dsa_sparse_mla {
namespace {

constexpr size_t kSmemBytes = sizeof(Fp8Smem) + kSmemAlign;  // + room to align the base to 1024

// cudaFuncSetAttribute is per device; remember which devices were configured per instantiation.
template <int kRows, int kHeadBlocks>
int ensure_smem_attribute() {
  static std::atomic<uint64_t> configured{0};
  int dev = 0;
  DSA_CUDA_CHECK(cudaGetDevice(&dev));
  const uint64_t bit = dev < 64 ? (uint64_t{1} << dev) : 0;
  if (bit != 0 && (configured.load(std::memory_order_relaxed) & bit)) return DSA_OK;
  int max_optin = 0;
  DSA_CUDA_CHECK(cudaDeviceGetAttribute(&max_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  DSA_CHECK_SUPPORTED(static_cast<size_t>(max_optin) >= kSmemBytes,
                      "sparse_mla: the fp8 kernel needs %zu bytes of shared memory per block, device %d allows %d "
                      "(sm_90 required)",
                      kSmemBytes, dev, max_optin);
  DSA_CUDA_CHECK(cudaFuncSetAttribute(sparse_mla_fp8_kernel<kRows, kHeadBlocks>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(kSmemBytes)));
  configured.fetch_or(bit, std::memory_order_relaxed);
  return DSA_OK;
}

template <int kRows, int kHeadBlocks>
int launch_rows(const DsaSparseMlaParams& p, cudaStream_t stream) {
  const int status = ensure_smem_attribute<kRows, kHeadBlocks>();
  if (status != DSA_OK) return status;
  const int64_t blocks = p.num_tokens * kHeadBlocks;
  DSA_CHECK_ARG(blocks <= INT32_MAX, "sparse_mla: num_tokens=%lld gives %lld blocks (> 2^31 - 1)",
                static_cast<long long>(p.num_tokens), static_cast<long long>(blocks));
  sparse_mla_fp8_kernel<kRows, kHeadBlocks><<<static_cast<unsigned>(blocks), kThreads, kSmemBytes, stream>>>(p);
  DSA_CUDA_CHECK_LAUNCH();
  return DSA_OK;
}

}  // namespace

int launch_fp8(const DsaSparseMlaParams& p, cudaStream_t stream) {
  switch (p.num_heads) {  // real heads in the 64-row block
    case 16: return launch_rows<16, 1>(p, stream);
    case 32: return launch_rows<32, 1>(p, stream);
    case 64: return launch_rows<64, 1>(p, stream);
    case 128: return launch_rows<64, 2>(p, stream);
    default: break;
  }
  return dsa_set_error(DSA_ERR_UNSUPPORTED, "sparse_mla: num_heads=%d unsupported (16, 32, 64, 128)", p.num_heads);
}

}  // namespace dsa_sparse_mla
