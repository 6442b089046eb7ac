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

// The fused Adam update's types: calls f(Tag<P>, Tag<G>, Tag<O>, std::bool_constant<kRem>) for the
// param, grad and param_out (NoList if absent) element types, kRem when bf16 params carry int16
// remainders (the binding layer has checked that remainders only come with bf16 params).
template <typename F>
void dispatch_adam(const TensorList& params, const TensorList& grads, const TensorList& param_outs,
                   bool remainders, F&& f) {
  dispatch_float(params.dtype, "adam param", [&](auto p) {
    dispatch_float(grads.dtype, "adam grad", [&](auto g) {
      dispatch_float_or_none(param_outs, "adam param_out", [&](auto o) {
        if constexpr (std::is_same_v<typename decltype(p)::type, bf16_t>) {
          if (remainders) {
            f(p, g, o, std::true_type{});
            return;
          }
        }
        f(p, g, o, std::false_type{});
      });
    });
  });
}

}  // namespace distopt
