// Shared by trainguard's C++ shims: run a body, turn any C++ exception into a message for Rust.
#pragma once
#include <cstring>
#include <exception>
#include <string>

namespace trainguard {
inline void copy_message(const std::string& text, char* out, size_t out_len) {
  if (out == nullptr || out_len == 0) return;
  size_t n = text.size() < out_len - 1 ? text.size() : out_len - 1;
  std::memcpy(out, text.data(), n);
  out[n] = '\0';
}

// 0 when `body` returned, 1 when it threw (the message is in `err`).
template <typename F>
int guarded(char* err, size_t err_len, F&& body) {
  try {
    body();
    return 0;
  } catch (const std::exception& e) {
    copy_message(e.what(), err, err_len);
  } catch (...) {
    copy_message("unknown C++ exception", err, err_len);
  }
  return 1;
}
}  // namespace trainguard
