// DSA-TRT kernel library: host-side state of the process (common.cuh, dsa_kernels.h): the
// thread-local last-error message, and the kernel attributes set per device.
#include <stdarg.h>
#include <stdio.h>

#include <mutex>
#include <vector>

#include "common.cuh"

namespace {
thread_local char g_last_error[1024] = "no error";
}

int dsa_set_error(int code, const char* fmt, ...) {
  va_list args;
  va_start(args, fmt);
  vsnprintf(g_last_error, sizeof(g_last_error), fmt, args);
  va_end(args);
  return code;
}

extern "C" const char* dsa_last_error_message(void) { return g_last_error; }

int dsa_kernel_attributes(const char* op, const void* kernel, size_t smem_bytes, bool non_portable_clusters) {
  int dev = 0;
  DSA_CUDA_CHECK(cudaGetDevice(&dev));
  struct Done {
    int dev;
    const void* kernel;
    size_t smem;
    bool non_portable;
  };
  static std::mutex mutex;
  static std::vector<Done> done;  // (device, kernel) pairs configured so far
  std::lock_guard<std::mutex> lock(mutex);
  Done* d = nullptr;
  for (Done& e : done)
    if (e.dev == dev && e.kernel == kernel) d = &e;
  if (d && d->smem >= smem_bytes && (d->non_portable || !non_portable_clusters)) return DSA_OK;
  if (!d) {
    done.push_back(Done{dev, kernel, 0, false});
    d = &done.back();
  }
  if (smem_bytes > d->smem) {
    int optin = 0;
    DSA_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
    DSA_CHECK_SUPPORTED(smem_bytes <= static_cast<size_t>(optin),
                        "%s: the kernel needs %zu bytes of shared memory per block, device %d allows %d "
                        "(sm_90 required)",
                        op, smem_bytes, dev, optin);
    DSA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem_bytes)));
    d->smem = smem_bytes;
  }
  if (non_portable_clusters && !d->non_portable) {
    DSA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
    d->non_portable = true;
  }
  return DSA_OK;
}
