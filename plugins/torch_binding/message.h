// Error messages of the torch binding, built without iostreams.
//
// TORCH_CHECK_* format their arguments through std::ostringstream, instantiated in this library.
// On the H200 machine (torch 2.11+cu130) streaming an integer from here crashed the process
// (SIGSEGV in the stream's number formatting) instead of raising, so every message naming a size
// or a shape killed the caller. DSA_CHECK_* hand TORCH_CHECK_* one finished std::string (which
// c10::str passes through untouched); integers go through std::to_string.
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <type_traits>

namespace dsa_msg {

inline void put(std::string& s, const char* v) { s += v; }
inline void put(std::string& s, const std::string& v) { s += v; }
inline void put(std::string& s, bool v) { s += v ? "true" : "false"; }
template <typename T, std::enable_if_t<std::is_arithmetic_v<T> && !std::is_same_v<T, bool>, int> = 0>
inline void put(std::string& s, T v) {
  s += std::to_string(v);
}
inline void put(std::string& s, const c10::Device& d) { s += d.str(); }
inline void put(std::string& s, at::ScalarType t) { s += c10::toString(t); }
// "(2, 64, 128)", "(5,)", "()" like a Python tuple
inline void put(std::string& s, at::IntArrayRef d) {
  s += "(";
  for (size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  s += d.size() == 1 ? ",)" : ")";
}

template <typename... A>
std::string cat(const A&... a) {
  std::string s;
  (put(s, a), ...);
  return s;
}

}  // namespace dsa_msg

#define DSA_CHECK_VALUE(cond, ...) TORCH_CHECK_VALUE(cond, ::dsa_msg::cat(__VA_ARGS__))
#define DSA_CHECK_NOT_IMPLEMENTED(cond, ...) TORCH_CHECK_NOT_IMPLEMENTED(cond, ::dsa_msg::cat(__VA_ARGS__))
#define DSA_CHECK(cond, ...) TORCH_CHECK(cond, ::dsa_msg::cat(__VA_ARGS__))
