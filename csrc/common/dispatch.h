// The one dtype dispatch: maps a runtime DType to a compile-time element type.
//
// `dispatch_float(dtype, f)` calls `f(Tag<T>{})` with T in {float, half_t, bf16_t}; kernels nest it
// once per list whose dtype is free. `dispatch_float_or_none` adds `NoList` for an optional list
// (an empty TensorList), so an absent output costs no runtime branch inside the kernel.
#pragma once

#include <stdexcept>
#include <type_traits>
#include <string>

#include "types.h"

namespace distopt {

template <typename T>
struct Tag {
  using type = T;
};

// Element type of an optional list that is absent.
struct NoList {};

template <typename T>
constexpr bool is_present = !std::is_same_v<T, NoList>;

inline const char* dtype_name(DType d) {
  switch (d) {
    case DType::Float32: return "float32";
    case DType::Float16: return "float16";
    case DType::BFloat16: return "bfloat16";
    case DType::Int16: return "int16";
  }
  return "unknown";
}

template <typename F>
decltype(auto) dispatch_float(DType d, const char* what, F&& f) {
  switch (d) {
    case DType::Float32: return f(Tag<float>{});
    case DType::Float16: return f(Tag<half_t>{});
    case DType::BFloat16: return f(Tag<bf16_t>{});
    default: break;
  }
  throw std::invalid_argument(std::string(what) + ": unsupported dtype " + dtype_name(d));
}

template <typename F>
decltype(auto) dispatch_float_or_none(const TensorList& list, const char* what, F&& f) {
  if (list.empty()) return f(Tag<NoList>{});
  return dispatch_float(list.dtype, what, static_cast<F&&>(f));
}

}  // namespace distopt
