// DSA-TRT kernel library: the thread-local last-error message (common.cuh, dsa_kernels.h).
#include <stdarg.h>
#include <stdio.h>

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
