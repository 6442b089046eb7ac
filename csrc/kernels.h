// The ATen-free interface between the binding layer and the CPU/CUDA kernels.
//
// Every list argument holds same-dtype tensors with `numel[i]` elements at index i; the binding layer
// has already checked lengths, dtypes, devices and contiguity. Device scalars (grad_scale, found_inf,
// lr, steps) are float32 pointers in the same memory as the lists (host memory for the CPU kernels).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "common/types.h"
#include "math/adam.h"
#include "math/state_format.h"

namespace distopt {

// The start of every invalid-argument message (std::invalid_argument) an op throws, from the binding's
// checks or the kernels' own (a forced CPU ISA): distopt/ops.py knows them by it (binding.h, "Errors").
inline constexpr const char* kArgumentError = "distopt: ";

// Lists of the fused Adam update; positions in TensorLists::lists. The scales lists (one fp32 absmax
// per kQuantBlock elements of an 8-bit moment, see math/state_format.h) have ceil(numel / kQuantBlock)
// elements per entry, not numel.
enum AdamList : int {
  kParam = 0, kGrad, kExpAvg, kExpAvgSq, kParamOut, kRemainder, kExpAvgScale, kExpAvgSqScale, kNumAdamLists
};

struct AdamArgs {
  AdamHyper hyper;
  double lr = 0.0;                   // eager: this update's lr ...
  double step = 1.0;                 // ... and step number (already counting this update)
  const float* lr_ptr = nullptr;     // capturable: lr read from device memory instead
  TensorList steps;                  // capturable: one float32 step scalar per entry (else empty)
  const float* grad_scale = nullptr; // g = grad * (*grad_scale); nullptr means 1
  const float* found_inf = nullptr;  // nonzero: the update is skipped, nothing is written
  // How the moments are stored (the dtypes of exp_avg and exp_avg_sq; Note [State formats]).
  StateFormat exp_avg_format = StateFormat::Float32;
  StateFormat exp_avg_sq_format = StateFormat::Float32;
  // Stochastic rounding of every bf16 store (moments, and bf16 params without remainders), with the
  // bits of Note [Stochastic rounding bits]: the seed, and per entry its param id and the offset of its
  // first element within the param.
  bool stochastic_rounding = false;
  uint64_t seed = 0;
  std::vector<uint32_t> param_ids;
  std::vector<uint64_t> param_offsets;

  // Whether the update takes the fp32-moment loops (else the low-precision ones).
  bool plain_states() const {
    return exp_avg_format == StateFormat::Float32 && exp_avg_sq_format == StateFormat::Float32 &&
           !stochastic_rounding;
  }
};

// lists: param, grad, exp_avg, exp_avg_sq (fp32, bf16 or uint8 codes, as the formats say), param_out
// (may be empty; nullptr entries are skipped), remainder (may be empty; when present params are bf16
// high halves and remainders int16), the exp_avg and exp_avg_sq scales (present for 8-bit moments).
void adam_cpu(const TensorLists& lists, const AdamArgs& args);
// adam_cpu's low-precision-state traversal (cpu/adam_states.cpp), when !args.plain_states().
void adam_states_cpu(const TensorLists& lists, const AdamArgs& args);

// out[i] = ||lists.lists[0][i]||_2, *total = ||all||_2 in fp32; *found_inf = 1 if any element is
// inf/nan (left untouched otherwise; may be nullptr).
void l2norm_cpu(const TensorLists& lists, float* total, float* per_tensor, float* found_inf);

// lists: in, out. out = in * (*scale) (scale nullptr: plain cast copy). If found_inf_out is set, it
// is raised when any output is inf/nan. If skip_if is set and nonzero, nothing is written.
struct ScaleArgs {
  const float* scale = nullptr;
  float* found_inf_out = nullptr;
  const float* skip_if = nullptr;
};
void scale_cpu(const TensorLists& lists, const ScaleArgs& args);

// The CUDA launchers (csrc/cuda): the same contracts, launched on `stream` (a cudaStream_t), never
// synchronising. In distopt._C_cuda, and in distopt._C_emulated, which compiles the same kernels as host
// C++ against the SIMT emulator (csrc/testing/simt) and runs them on CPU tensors.
void adam_cuda(const TensorLists& lists, const AdamArgs& args, void* stream);

// `workspace` must hold l2norm_cuda_workspace_floats(lists) floats of device memory.
int64_t l2norm_cuda_workspace_floats(const TensorLists& lists);
void l2norm_cuda(const TensorLists& lists, float* total, float* per_tensor, float* found_inf,
                 float* workspace, void* stream);

void scale_cuda(const TensorLists& lists, const ScaleArgs& args, void* stream);

}  // namespace distopt
