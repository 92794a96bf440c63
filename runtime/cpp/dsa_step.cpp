// dsa_step: one decode step of a CUDA AOTInductor engine package, run with no Python interpreter.
//
//   build/dsa_step <rank0.pt2> <inputs.dsat> <logits.dsat> [--warmup N] [--iters N] [--device I]
//
// The process holds libtorch, the dsa op schemas (plugins/torch_binding/dsa_schemas.cpp, linked in)
// and the CUDA kernels (libdsa_torch_ops.so, linked --no-as-needed so its registrars run): the
// package's calls to torch.ops.dsa.* go through the dispatcher to the kernels.
//
// inputs.dsat holds the program's flat inputs in call order: the StepInputs tensors
// (StepInputs.as_tuple()), then the MLA pools, then the indexer pools of every layer, as
// benchmarks/step_runner_check.py writes them. The pools are mutated by the step (the cache
// writes of its tokens), so repeated runs write the same rows again and give the same logits.
// The first output (logits) is written to logits.dsat as fp32; the wall time of each timed run
// (host launch to device idle) is printed.
//
// .dsat: "DSATENS1", int64 count, then per tensor int64 dtype (c10::ScalarType), int64 ndim,
// int64 dims[ndim], int64 nbytes, the contiguous bytes; host byte order (little-endian).
#include <c10/cuda/CUDAFunctions.h>
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>

#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

constexpr char kMagic[8] = {'D', 'S', 'A', 'T', 'E', 'N', 'S', '1'};

// The dtypes a step's inputs and outputs use; anything else in a file is refused by name.
bool known_dtype(int64_t code) {
  switch (static_cast<at::ScalarType>(code)) {
    case at::kByte: case at::kChar: case at::kShort: case at::kInt: case at::kLong: case at::kHalf:
    case at::kFloat: case at::kDouble: case at::kBool: case at::kBFloat16: case at::kFloat8_e4m3fn:
      return true;
    default:
      return false;
  }
}

int64_t read_i64(std::ifstream& f, const std::string& path) {
  int64_t v = 0;
  if (!f.read(reinterpret_cast<char*>(&v), sizeof(v))) throw std::runtime_error(path + ": truncated file");
  return v;
}

std::vector<at::Tensor> read_tensors(const std::string& path, const at::Device& device) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw std::runtime_error(path + ": cannot open");
  char magic[8];
  if (!f.read(magic, 8) || std::memcmp(magic, kMagic, 8) != 0)
    throw std::runtime_error(path + ": not a .dsat tensor file (write it with benchmarks/step_runner_check.py)");
  const int64_t count = read_i64(f, path);
  if (count < 0 || count > (1 << 20)) throw std::runtime_error(path + ": bad tensor count " + std::to_string(count));
  std::vector<at::Tensor> out;
  for (int64_t i = 0; i < count; ++i) {
    const int64_t dtype = read_i64(f, path), ndim = read_i64(f, path);
    const std::string what = path + ": tensor " + std::to_string(i);
    if (!known_dtype(dtype)) throw std::runtime_error(what + ": unknown dtype code " + std::to_string(dtype));
    if (ndim < 0 || ndim > 8) throw std::runtime_error(what + ": bad rank " + std::to_string(ndim));
    std::vector<int64_t> dims(ndim);
    for (auto& d : dims) d = read_i64(f, path);
    const int64_t nbytes = read_i64(f, path);
    at::Tensor t = at::empty(dims, at::TensorOptions().dtype(static_cast<at::ScalarType>(dtype)));
    if (nbytes != static_cast<int64_t>(t.nbytes()))
      throw std::runtime_error(what + ": " + std::to_string(nbytes) + " bytes for " + std::to_string(t.nbytes()));
    if (nbytes && !f.read(static_cast<char*>(t.data_ptr()), nbytes)) throw std::runtime_error(what + ": truncated");
    out.push_back(t.to(device));
  }
  return out;
}

void write_i64(std::ofstream& f, int64_t v) { f.write(reinterpret_cast<const char*>(&v), sizeof(v)); }

void write_tensors(const std::string& path, const std::vector<at::Tensor>& tensors) {
  std::ofstream f(path, std::ios::binary);
  if (!f) throw std::runtime_error(path + ": cannot write");
  f.write(kMagic, 8);
  write_i64(f, static_cast<int64_t>(tensors.size()));
  for (const at::Tensor& t : tensors) {
    const at::Tensor c = t.to(at::kCPU).contiguous();
    write_i64(f, static_cast<int64_t>(c.scalar_type()));
    write_i64(f, c.dim());
    for (int64_t d : c.sizes()) write_i64(f, d);
    write_i64(f, static_cast<int64_t>(c.nbytes()));
    f.write(static_cast<const char*>(c.data_ptr()), static_cast<std::streamsize>(c.nbytes()));
  }
  if (!f) throw std::runtime_error(path + ": write failed");
}

int usage(const char* argv0) {
  std::fprintf(stderr, "usage: %s <package.pt2> <inputs.dsat> <logits.dsat> [--warmup N] [--iters N] [--device I]\n",
               argv0);
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 4) return usage(argv[0]);
  const std::string package = argv[1], inputs_path = argv[2], logits_path = argv[3];
  int warmup = 3, iters = 20, device_index = 0;
  for (int i = 4; i < argc; ++i) {
    const std::string a = argv[i];
    if (i + 1 >= argc) return usage(argv[0]);
    const int v = std::atoi(argv[++i]);
    if (a == "--warmup") warmup = std::max(0, v);
    else if (a == "--iters") iters = std::max(1, v);
    else if (a == "--device") device_index = std::max(0, v);
    else return usage(argv[0]);
  }
  try {
    const at::Device device(at::kCUDA, static_cast<c10::DeviceIndex>(device_index));
    c10::cuda::set_device(static_cast<c10::DeviceIndex>(device_index));
    std::vector<at::Tensor> inputs = read_tensors(inputs_path, device);
    // single-threaded runner, as runtime/engine.py loads CUDA packages (graph-capture safe)
    torch::inductor::AOTIModelPackageLoader loader(package, "model", /*run_single_threaded=*/true, 1,
                                                   static_cast<c10::DeviceIndex>(device_index));
    std::vector<at::Tensor> out;
    for (int i = 0; i < warmup; ++i) out = loader.run(inputs);
    c10::cuda::device_synchronize();
    std::vector<double> us;
    for (int i = 0; i < iters; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      out = loader.run(inputs);
      c10::cuda::device_synchronize();
      us.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
    }
    if (out.empty()) throw std::runtime_error(package + ": the program returned no output");
    write_tensors(logits_path, {out[0].to(at::kFloat)});
    std::sort(us.begin(), us.end());
    double sum = 0;
    for (double u : us) sum += u;
    std::printf("dsa_step: %zu inputs, logits %s, %d warm-up + %d runs: mean %.1f us, median %.1f us, min %.1f us\n",
                inputs.size(), c10::str(out[0].sizes()).c_str(), warmup, iters, sum / us.size(), us[us.size() / 2],
                us.front());
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dsa_step: %s\n", e.what());
    return 1;
  }
}
