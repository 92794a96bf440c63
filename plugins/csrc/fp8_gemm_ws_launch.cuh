// DSA-TRT kernels: the host side of fp8_gemm_ws.cuh's GEMM, shared by the linear (fp8_linear.cu)
// and the MoE's grouped GEMMs (moe_experts.cu): the TMA tensor maps and the persistent grid's launch.
#pragma once

#include <cudaTypedefs.h>

#include <atomic>

#include "fp8_gemm_ws.cuh"

namespace dsa_fp8_ws {

// ---------------------------------------------------------------- host: tensor maps
// cuTensorMapEncodeTiled through the runtime's driver entry point (no -lcuda link); NULL if the
// driver has none.
static inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess)
      p = nullptr;
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
  }();
  return fn;
}

// Row-major [outer, inner] tensor of `type` elements, rows `row_bytes` apart (a multiple of
// 16), boxes of [box_outer, box_inner]; out-of-bounds elements read as zero. `what`: "op: tensor",
// the errors' prefix.
static inline int encode_tensor_map_2d(CUtensorMap* map, const void* base, CUtensorMapDataType type, uint64_t inner,
                                       uint64_t outer, uint64_t row_bytes, uint32_t box_inner, uint32_t box_outer,
                                       CUtensorMapSwizzle swizzle, const char* what) {
  const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
  DSA_CHECK_SUPPORTED(encode != nullptr,
                      "%s: the CUDA driver has no cuTensorMapEncodeTiled (TMA needs driver >= 12.0)", what);
  const cuuint64_t dims[2] = {inner, outer};
  const cuuint64_t strides[1] = {row_bytes};
  const cuuint32_t box[2] = {box_inner, box_outer};
  const cuuint32_t elem_strides[2] = {1, 1};
  const CUresult r = encode(map, type, 2, const_cast<void*>(base), dims, strides, box, elem_strides,
                            CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  DSA_CHECK_SUPPORTED(r == CUDA_SUCCESS,
                      "%s: cuTensorMapEncodeTiled(%llu x %llu, row %llu bytes, box %u x %u) failed "
                      "(CUresult %d)",
                      what, (unsigned long long)outer, (unsigned long long)inner, (unsigned long long)row_bytes,
                      box_outer, box_inner, (int)r);
  return DSA_OK;
}

// ---------------------------------------------------------------- host: the persistent grid
// Launches `kernel` (an fp8_gemm_ws_kernel) as a persistent grid of clusters of mc CTAs: as many
// clusters as can be resident at once on this device (GPCs of odd SM counts leave SMs out of
// pairs; asked once per kernel and device through `cache`, the caller's one per kernel), at most
// `units`. pdl: with programmatic dependent launch. `op`: the errors' prefix.
template <typename Kernel>
static int launch_persistent(const char* op, Kernel kernel, int mc, int smem, int64_t units, bool pdl,
                             std::atomic<int> (&cache)[64], cudaStream_t stream, const WsArgs& g,
                             const CUtensorMap& mw, const CUtensorMap& mx, const CUtensorMap& ms,
                             const CUtensorMap& mo) {
  const int st = dsa_kernel_attributes(op, reinterpret_cast<const void*>(kernel), smem);
  if (st != DSA_OK) return st;
  int dev = 0, slots = 0;
  DSA_CUDA_CHECK(cudaGetDevice(&dev));
  cudaLaunchAttribute attr[2];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = static_cast<unsigned>(mc);
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cfg.attrs = attr;
  if (dev >= 0 && dev < 64 && cache[dev].load() > 0) {
    slots = cache[dev].load();
  } else if (mc == 1) {
    DSA_CUDA_CHECK(cudaDeviceGetAttribute(&slots, cudaDevAttrMultiProcessorCount, dev));
  } else {
    cfg.gridDim = dim3(static_cast<unsigned>(mc));
    cfg.numAttrs = 1;
    DSA_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&slots, kernel, &cfg));
    DSA_CHECK_SUPPORTED(slots > 0, "%s: no cluster of %d CTAs (%d bytes of shared memory each) fits device %d", op,
                        mc, smem, dev);
  }
  if (dev >= 0 && dev < 64) cache[dev].store(slots);
  cfg.gridDim = dim3(static_cast<unsigned>(mc * std::min<int64_t>(units, std::max(slots, 1))));
  int n = mc > 1 ? 1 : 0;
  if (pdl) attr[n++] = dsa_pdl_attr();
  cfg.numAttrs = n;
  DSA_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, g, mw, mx, ms, mo));
  return DSA_OK;
}

}  // namespace dsa_fp8_ws
