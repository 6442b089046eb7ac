// The argument checks and torch::stable::Tensor -> TensorList conversions every op shares; see binding.h.
#include "binding.h"

#include <algorithm>
#include <numeric>
#include <optional>

namespace distopt {

using torch::headeronly::DeviceType;
using torch::headeronly::ScalarType;
using IntArrayRef = torch::headeronly::IntHeaderOnlyArrayRef;

std::string device_name(const Device& device) {
  std::string name = device.type() == DeviceType::CPU    ? "cpu"
                     : device.type() == DeviceType::CUDA ? "cuda"
                                                         : "device type " + std::to_string(static_cast<int>(device.type()));
  return device.index() >= 0 ? name + ":" + std::to_string(device.index()) : name;
}

namespace {

// The kernels' dtype of a tensor's ScalarType, if they have one.
std::optional<DType> kernel_dtype(ScalarType t) {
  switch (t) {
    case ScalarType::Float: return DType::Float32;
    case ScalarType::Half: return DType::Float16;
    case ScalarType::BFloat16: return DType::BFloat16;
    case ScalarType::Short: return DType::Int16;
    case ScalarType::Byte: return DType::UInt8;
    default: return std::nullopt;
  }
}

}  // namespace

std::string scalar_type_name(ScalarType dtype) {
  if (const std::optional<DType> d = kernel_dtype(dtype)) return dtype_name(*d);
  switch (dtype) {  // the other dtypes a caller is likely to pass by mistake, named as torch names them
    case ScalarType::Double: return "float64";
    case ScalarType::Long: return "int64";
    case ScalarType::Int: return "int32";
    default: return torch::headeronly::toString(dtype);
  }
}

std::string shape_string(const Tensor& t) {
  std::string s = "[";
  for (int64_t d = 0; d < t.dim(); ++d) s += (d ? ", " : "") + std::to_string(t.size(d));
  return s + "]";
}

namespace {

DType to_dtype(ScalarType t) {
  const std::optional<DType> d = kernel_dtype(t);
  if (!d) fail("unsupported dtype ", scalar_type_name(t));
  return *d;
}

bool is_float_dtype(ScalarType t) {
  return t == ScalarType::Float || t == ScalarType::Half || t == ScalarType::BFloat16;
}

// Whether `sizes` and `strides` are row-major contiguous (dims of size 1 take any stride).
bool contiguous(IntArrayRef sizes, IntArrayRef strides) {
  int64_t expected = 1;
  for (size_t d = sizes.size(); d-- > 0;) {
    if (sizes[d] != 1 && strides[d] != expected) return false;
    expected *= sizes[d];
  }
  return true;
}

// c10's TensorImpl::compute_non_overlapping_and_dense: ordered by stride (dims of size < 2 last), the
// strides are the running products of the sizes. Any dense layout qualifies (e.g. channels_last).
bool non_overlapping_and_dense(IntArrayRef sizes, IntArrayRef strides) {
  if (contiguous(sizes, strides)) return true;  // the common case, decided without sorting
  const size_t dim = sizes.size();
  std::vector<size_t> perm(dim);
  std::iota(perm.begin(), perm.end(), size_t{0});
  std::stable_sort(perm.begin(), perm.end(), [&](size_t a, size_t b) {
    if (sizes[a] < 2) return false;
    if (sizes[b] < 2) return true;
    return strides[a] < strides[b];
  });
  int64_t required = 1;
  for (const size_t d : perm) {
    if (sizes[d] < 2) return true;
    if (strides[d] != required) return false;
    required *= sizes[d];
  }
  return true;
}

}  // namespace

// Note [Raw tensor properties]
// describe() runs for every tensor of every list of every op call: thousands per step for a model of
// many small params. torch::stable::Tensor's scalar_type(), device() and layout() convert the C shim's
// codes into ScalarType/Device/Layout by comparing them with one shim call per known value, which made
// those conversions most of an op's host time. So each tensor's properties are read once as the shim's
// raw codes (RawTensor) and compared as such; a list's first dtype is converted once, and a tensor's
// properties only again to name them in an error.
TensorHandles::~TensorHandles() {
  for (AtenTensorHandle h : handles_) aoti_torch_delete_tensor_object(h);
}

Tensor TensorHandles::operator[](size_t i) const { return tensor_of(handles_.at(i)); }

Tensor tensor_of(AtenTensorHandle handle) {
  AtenTensorHandle reference = nullptr;
  TORCH_ERROR_CODE_CHECK(aoti_torch_new_tensor_handle(handle, &reference));
  return Tensor(reference);
}

int64_t RawTensor::numel() const {
  return std::accumulate(sizes.begin(), sizes.end(), int64_t{1}, std::multiplies<int64_t>());
}

RawTensor read_raw(AtenTensorHandle h) {
  RawTensor r;
  r.handle = h;
  int64_t dim = 0;
  int64_t* sizes = nullptr;
  int64_t* strides = nullptr;
  TORCH_ERROR_CODE_CHECK(aoti_torch_get_dtype(h, &r.dtype));
  TORCH_ERROR_CODE_CHECK(aoti_torch_get_device_type(h, &r.device_type));
  TORCH_ERROR_CODE_CHECK(aoti_torch_get_device_index(h, &r.device_index));
  TORCH_ERROR_CODE_CHECK(aoti_torch_get_layout(h, &r.layout));
  TORCH_ERROR_CODE_CHECK(aoti_torch_get_dim(h, &dim));
  TORCH_ERROR_CODE_CHECK(aoti_torch_get_sizes(h, &sizes));
  TORCH_ERROR_CODE_CHECK(aoti_torch_get_strides(h, &strides));
  TORCH_ERROR_CODE_CHECK(aoti_torch_get_data_ptr(h, &r.data));
  r.sizes = IntArrayRef(sizes, static_cast<size_t>(dim));  // borrowed from t, as Tensor::sizes()
  r.strides = IntArrayRef(strides, static_cast<size_t>(dim));
  return r;
}

std::vector<RawTensor> read_raw(const Tensors& list) {
  std::vector<RawTensor> out;
  out.reserve(list.size());
  for (size_t i = 0; i < list.size(); ++i) out.push_back(read_raw(list.handle(i)));
  return out;
}

TensorList describe(const Tensors& list, const std::vector<RawTensor>& raw, const std::vector<RawTensor>& ref,
                    const char* name, const char* allowed) {
  DISTOPT_CHECK(list.size() == ref.size(), name, ": expected ", ref.size(), " tensors, got ", list.size());
  TensorList out;
  if (list.empty()) return out;
  const ScalarType dtype = list[0].scalar_type();
  const std::string kind(allowed);
  const bool ok = kind == "float"   ? is_float_dtype(dtype)
                  : kind == "fp32"  ? dtype == ScalarType::Float
                  : kind == "state" ? (dtype == ScalarType::Float || dtype == ScalarType::BFloat16 ||
                                       dtype == ScalarType::Byte)
                                    : dtype == ScalarType::Short;
  DISTOPT_CHECK(ok, name, ": expected ", kind == "state" ? "fp32, bf16 or uint8 (8-bit blockwise)" : allowed,
                " tensors, got ", scalar_type_name(dtype));
  out.dtype = to_dtype(dtype);
  out.data.reserve(list.size());
  const int32_t strided = aoti_torch_layout_strided();
  for (size_t i = 0; i < list.size(); ++i) {
    const RawTensor& t = raw[i];
    const RawTensor& r = ref[i];
    DISTOPT_CHECK(t.dtype == raw[0].dtype, name, "[", i, "]: dtype ", scalar_type_name(list[i].scalar_type()),
                  " differs from ", name, "[0] (", scalar_type_name(dtype), "); group tensors by dtype");
    DISTOPT_CHECK(t.device_type == r.device_type && t.device_index == r.device_index, name, "[", i, "] is on ",
                  device_name(list[i].device()), ", expected ", device_name(tensor_of(r.handle).device()));
    DISTOPT_CHECK(t.layout == strided, name, "[", i, "]: expected a dense tensor");
    DISTOPT_CHECK(t.sizes.equals(r.sizes), name, "[", i, "]: shape ", shape_string(list[i]), " differs from ",
                  shape_string(tensor_of(r.handle)));
    // Elements are walked in memory order, so every list must share the reference's layout.
    DISTOPT_CHECK(non_overlapping_and_dense(t.sizes, t.strides) && t.strides.equals(r.strides), name, "[", i,
                  "]: expected a dense tensor with the same strides as its partners");
    out.data.push_back(t.data);
  }
  return out;
}

std::vector<int64_t> numels(const std::vector<RawTensor>& list) {
  std::vector<int64_t> n;
  n.reserve(list.size());
  for (const RawTensor& t : list) n.push_back(t.numel());
  return n;
}

float* scalar_ptr(const OptionalTensor& t, const Device& device, const char* name) {
  if (!t.has_value()) return nullptr;
  DISTOPT_CHECK(t->scalar_type() == ScalarType::Float, name, ": expected a float32 tensor, got ",
                scalar_type_name(t->scalar_type()));
  DISTOPT_CHECK(t->numel() == 1, name, ": expected one element, got ", t->numel());
  DISTOPT_CHECK(t->device() == device, name, " is on ", device_name(t->device()), ", expected ",
                device_name(device), " (where the tensors are)");
  return static_cast<float*>(t->data_ptr());
}

double cpu_scalar(const Tensor& t, const char* name) {
  DISTOPT_CHECK(t.numel() == 1, name, ": expected one element, got ", t.numel());
  if (t.scalar_type() == ScalarType::Double) return *static_cast<const double*>(t.const_data_ptr());
  if (t.scalar_type() == ScalarType::Float) return *static_cast<const float*>(t.const_data_ptr());
  const Tensor as_double = torch::stable::to(t, ScalarType::Double);  // any other real dtype, as item() reads it
  return *as_double.const_data_ptr<double>();
}

// lr: on the CPU it is read now (an eager step); on the params' device the kernel reads it (a
// capturable step: no host sync; a captured graph replays with the value it holds then).
void set_lr(AdamArgs& args, const Tensor& lr, const Device& device) {
  if (!lr.is_cpu()) {
    args.lr_ptr = scalar_ptr(lr, device, "lr");
    return;
  }
  args.lr = cpu_scalar(lr, "lr");
  DISTOPT_CHECK(args.lr >= 0.0, "lr must be >= 0, got ", args.lr);
}

// steps count this update (>= 1): one for every entry, or one per entry. A single step on the CPU is
// read now (an eager step); otherwise they are float32 scalars on the params' device, read by the
// kernel (the same tensor may appear for many entries).
void set_steps(AdamArgs& args, const Tensors& steps, const Tensors& params) {
  const size_t count = params.size();
  DISTOPT_CHECK(steps.size() == 1 || steps.size() == count, "steps: expected one step tensor, or one per param (",
                count, "), got ", steps.size());
  const std::vector<RawTensor> raw = read_raw(steps);
  if (steps.size() == 1 && raw[0].device_type == aoti_torch_device_type_cpu()) {
    args.step = cpu_scalar(steps[0], "steps[0]");
    DISTOPT_CHECK(args.step >= 1.0, "step counts this update and must be >= 1, got ", args.step);
    return;
  }
  const RawTensor where = read_raw(params.handle(0));
  args.steps.dtype = DType::Float32;
  args.steps.data.reserve(count);
  for (size_t i = 0; i < count; ++i) {
    const RawTensor& t = raw[steps.size() == 1 ? 0 : i];
    if (t.dtype != aoti_torch_dtype_float32() || t.numel() != 1 || t.device_type != where.device_type ||
        t.device_index != where.device_index) {
      scalar_ptr(tensor_of(t.handle), params[0].device(), "steps[i]");  // names what is wrong
      fail("steps[", i, "]: expected a float32 one-element tensor on the params' device");
    }
    args.steps.data.push_back(t.data);
  }
}

StateFormat state_format(const Tensors& states) {
  if (states.empty() || states[0].scalar_type() == ScalarType::Float) return StateFormat::Float32;
  return states[0].scalar_type() == ScalarType::BFloat16 ? StateFormat::BFloat16 : StateFormat::Blockwise8;
}

namespace {

// The absmax list of an 8-bit moment list (one fp32 per kQuantBlock elements of each entry, contiguous,
// beside its codes); empty for the other formats. `states` is the moment list as described against `ref`
// (the params: the same devices and numels).
TensorList describe_scales(const Tensors& scales, const Tensors& state_tensors, const TensorList& states,
                           const std::vector<RawTensor>& ref, const char* name, const char* states_name) {
  if (state_format(state_tensors) != StateFormat::Blockwise8) {
    DISTOPT_CHECK(scales.empty(), name, ": only 8-bit (uint8) ", states_name, " have scales, got ", scales.size(),
                  " tensors for ", scalar_type_name(state_tensors[0].scalar_type()));
    return TensorList{};
  }
  DISTOPT_CHECK(scales.size() == ref.size(), name, ": expected one absmax tensor per entry of ", states_name, " (",
                ref.size(), "), got ", scales.size());
  TensorList out;
  out.dtype = DType::Float32;
  out.data.reserve(scales.size());
  const std::vector<RawTensor> raw = read_raw(scales);
  for (size_t i = 0; i < scales.size(); ++i) {
    const RawTensor& t = raw[i];
    const int64_t blocks = (ref[i].numel() + kQuantBlock - 1) / kQuantBlock;
    DISTOPT_CHECK(t.dtype == aoti_torch_dtype_float32(), name, "[", i, "]: expected float32, got ",
                  scalar_type_name(scales[i].scalar_type()));
    DISTOPT_CHECK(t.device_type == ref[i].device_type && t.device_index == ref[i].device_index, name, "[", i,
                  "] is on ", device_name(scales[i].device()), ", expected ", device_name(state_tensors[i].device()));
    DISTOPT_CHECK(t.numel() == blocks && t.layout == aoti_torch_layout_strided() && contiguous(t.sizes, t.strides),
                  name, "[", i, "]: expected ", blocks, " contiguous elements (one per ", kQuantBlock, " of ",
                  states_name, "[", i, "]), got ", t.numel());
    DISTOPT_CHECK(blocks == 0 || t.data != states.data[i], name, "[", i, "] must not alias ", states_name, "[", i,
                  "]");
    out.data.push_back(t.data);
  }
  return out;
}

}  // namespace

// Note [Packed moments]
// A moment list holds one tensor per param (its shape and strides) or, for more than one param, a single
// packed tensor: 1-D, contiguous, fp32 or bf16, entry i's moment being the numel(params[i]) elements from
// element packed_offset(i) on, in params[i]'s memory order (the order every list is walked in), where
// packed_offset(0) = 0 and each next one is the last plus its numel rounded up to kPackAlign elements (so
// that every entry starts 64-byte aligned for fp32, 32-byte for bf16; distopt/kernel_views.py
// packed_offsets, which distopt.ops exports, is the same rule). Why: the tensors of an op's lists cross
// torch's stable ABI one by one (a new C++ handle, its checks, its release: about a fifth of a
// microsecond each), the largest part of the host time of a call over thousands of small params; a caller
// that keeps its moments packed (FusedAdam's step plan) passes two tensors instead of two per param. 8-bit
// moments, whose absmax lists are per entry, are not packed.
namespace {

constexpr int64_t kPackAlign = 16;

// Elements an entry of `numel` elements takes in a packed tensor.
int64_t packed_numel(int64_t numel) { return (numel + kPackAlign - 1) / kPackAlign * kPackAlign; }

TensorList describe_moments(const Tensors& list, const std::vector<RawTensor>& ref, const std::vector<int64_t>& numel,
                            const char* name) {
  if (list.size() != 1 || ref.size() < 2) return describe(list, read_raw(list), ref, name, "state");
  const RawTensor t = read_raw(list)[0];
  const ScalarType dtype = list[0].scalar_type();
  DISTOPT_CHECK(dtype == ScalarType::Float || dtype == ScalarType::BFloat16, name, ": expected ", ref.size(),
                " tensors (one per param) or one packed fp32 or bf16 tensor, got one ", scalar_type_name(dtype),
                " tensor (8-bit moments are passed one tensor per param)");
  DISTOPT_CHECK(t.device_type == ref[0].device_type && t.device_index == ref[0].device_index, name,
                " (packed) is on ", device_name(list[0].device()), ", expected ",
                device_name(tensor_of(ref[0].handle).device()));
  int64_t extent = 0;
  for (const int64_t n : numel) extent += packed_numel(n);
  DISTOPT_CHECK(t.layout == aoti_torch_layout_strided() && t.sizes.size() == 1 && (t.sizes[0] < 2 || t.strides[0] == 1) &&
                    t.sizes[0] >= extent,
                name, ": a packed moment tensor must be 1-D and contiguous with at least ", extent,
                " elements (the params' numels, each rounded up to ", kPackAlign, "), got shape ", shape_string(list[0]));
  TensorList out;
  out.dtype = to_dtype(dtype);
  const int64_t element_size = static_cast<int64_t>(aoti_torch_dtype_element_size(t.dtype));
  char* base = static_cast<char*>(t.data);
  int64_t offset = 0;
  out.data.reserve(numel.size());
  for (const int64_t n : numel) {
    out.data.push_back(base + offset * element_size);
    offset += packed_numel(n);
  }
  return out;
}

}  // namespace

TensorLists describe_adam(const Tensors& params, const Tensors& grads, const Tensors& exp_avgs,
                          const Tensors& exp_avg_sqs, const Tensors& param_outs, const Tensors& param_remainders,
                          const Tensors& exp_avg_scales, const Tensors& exp_avg_sq_scales) {
  TensorLists tl;
  tl.lists.resize(kNumAdamLists);
  const std::vector<RawTensor> ref = read_raw(params);  // the partners every list is checked against
  tl.lists[kParam] = describe(params, ref, ref, "params", "float");
  tl.lists[kGrad] = describe(grads, read_raw(grads), ref, "grads", "float");
  tl.numel = numels(ref);
  tl.lists[kExpAvg] = describe_moments(exp_avgs, ref, tl.numel, "exp_avgs");  // Note [Packed moments]
  tl.lists[kExpAvgSq] = describe_moments(exp_avg_sqs, ref, tl.numel, "exp_avg_sqs");
  const std::vector<void*>& p = tl.lists[kParam].data;
  if (!param_outs.empty()) {
    tl.lists[kParamOut] = describe(param_outs, read_raw(param_outs), ref, "param_outs", "float");
    for (size_t i = 0; i < params.size(); ++i) {
      // Empty tensors all have data_ptr() == nullptr: nothing to alias, nothing to write.
      if (tl.numel[i] > 0 && tl.lists[kParamOut].data[i] == p[i]) {
        DISTOPT_CHECK(tl.lists[kParamOut].dtype == tl.lists[kParam].dtype, "param_outs[", i, "] aliases params[",
                      i, "] with another dtype");
        tl.lists[kParamOut].data[i] = nullptr;  // aliases the param: nothing more to write
      }
    }
  }
  if (!param_remainders.empty()) {
    tl.lists[kRemainder] = describe(param_remainders, read_raw(param_remainders), ref, "param_remainders", "int16");
    DISTOPT_CHECK(params[0].scalar_type() == ScalarType::BFloat16, "param_remainders pair with bfloat16 params, got ",
                  scalar_type_name(params[0].scalar_type()));
  }
  const std::vector<void*>& m = tl.lists[kExpAvg].data;
  const std::vector<void*>& v = tl.lists[kExpAvgSq].data;
  for (size_t i = 0; i < params.size(); ++i) {
    DISTOPT_CHECK(tl.numel[i] == 0 || (p[i] != m[i] && p[i] != v[i] && m[i] != v[i]), "params[", i, "], exp_avgs[",
                  i, "] and exp_avg_sqs[", i, "] must not alias");
  }
  tl.lists[kExpAvgScale] =
      describe_scales(exp_avg_scales, exp_avgs, tl.lists[kExpAvg], ref, "exp_avg_scales", "exp_avgs");
  tl.lists[kExpAvgSqScale] =
      describe_scales(exp_avg_sq_scales, exp_avg_sqs, tl.lists[kExpAvgSq], ref, "exp_avg_sq_scales", "exp_avg_sqs");
  const std::vector<void*>& ms = tl.lists[kExpAvgScale].data;
  const std::vector<void*>& vs = tl.lists[kExpAvgSqScale].data;
  for (size_t i = 0; i < ms.size() && i < vs.size(); ++i) {  // (an empty scale: the entry is empty too)
    DISTOPT_CHECK(tl.numel[i] == 0 || ms[i] != vs[i], "exp_avg_scales[", i, "] and exp_avg_sq_scales[", i,
                  "] must not alias");
  }
  return tl;
}

void set_rounding(AdamArgs& args, const std::optional<int64_t>& seed, const std::vector<int64_t>& param_ids,
                  const std::vector<int64_t>& param_offsets, size_t count) {
  DISTOPT_CHECK(param_ids.empty() || param_ids.size() == count, "param_ids: expected one id per param (", count,
                "), got ", param_ids.size());
  DISTOPT_CHECK(param_offsets.empty() || param_offsets.size() == count, "param_offsets: expected one offset per param (",
                count, "), got ", param_offsets.size());
  const bool blockwise =
      args.exp_avg_format == StateFormat::Blockwise8 || args.exp_avg_sq_format == StateFormat::Blockwise8;
  for (size_t i = 0; i < param_offsets.size(); ++i) {
    DISTOPT_CHECK(param_offsets[i] >= 0, "param_offsets[", i, "] must be >= 0, got ", param_offsets[i]);
    DISTOPT_CHECK(!blockwise || param_offsets[i] % kQuantBlock == 0, "param_offsets[", i, "] = ", param_offsets[i],
                  ": with 8-bit moments an entry must start at a multiple of ", kQuantBlock,
                  " elements of its param (its quantisation blocks are the param's)");
  }
  if (!seed.has_value()) return;
  DISTOPT_CHECK(param_ids.size() == count, "stochastic rounding (a rounding seed) needs param_ids: one id per param (",
                count, "), got ", param_ids.size());
  args.stochastic_rounding = true;
  args.seed = static_cast<uint64_t>(*seed);
  for (size_t i = 0; i < count; ++i) {
    DISTOPT_CHECK(param_ids[i] >= 0 && param_ids[i] <= 0xffffffffLL, "param_ids[", i, "] must be in [0, 2^32), got ",
                  param_ids[i]);
    args.param_ids.push_back(static_cast<uint32_t>(param_ids[i]));
  }
  for (const int64_t offset : param_offsets) args.param_offsets.push_back(static_cast<uint64_t>(offset));
}

AdamHyper make_hyper(double beta1, double beta2, double eps, double weight_decay, bool adam_w_mode, bool maximize) {
  DISTOPT_CHECK(beta1 >= 0.0 && beta1 < 1.0 && beta2 >= 0.0 && beta2 < 1.0, "betas must be in [0, 1), got (", beta1,
                ", ", beta2, ")");
  DISTOPT_CHECK(eps >= 0.0, "eps must be >= 0, got ", eps);
  DISTOPT_CHECK(weight_decay >= 0.0, "weight_decay must be >= 0, got ", weight_decay);
  AdamHyper h;
  h.beta1 = beta1;
  h.beta2 = beta2;
  h.eps = eps;
  h.weight_decay = weight_decay;
  h.adam_w_mode = adam_w_mode;
  h.maximize = maximize;
  return h;
}

TensorLists describe_scale(const Tensors& inputs, const Tensors& outputs, const char* op) {
  DISTOPT_CHECK(!inputs.empty(), op, ": expected at least one input");
  TensorLists tl;
  const std::vector<RawTensor> in = read_raw(inputs);
  const std::vector<RawTensor> out = read_raw(outputs);
  tl.lists = {describe(inputs, in, in, "inputs", "float"), describe(outputs, out, in, "outputs", "float")};
  tl.numel = numels(in);
  const TensorList& outs = tl.lists[1];
  const int64_t in_size = static_cast<int64_t>(aoti_torch_dtype_element_size(in[0].dtype));
  const int64_t out_size = static_cast<int64_t>(aoti_torch_dtype_element_size(out[0].dtype));
  for (size_t i = 0; i < inputs.size(); ++i) {
    // Exact aliasing (in place) is fine: each element is read before it is written. (Each list has one
    // dtype, and each output the shape of its input.)
    const auto* in_begin = static_cast<const char*>(tl.lists[0].data[i]);
    const auto* out_begin = static_cast<const char*>(outs.data[i]);
    const bool overlap = in_begin < out_begin + tl.numel[i] * out_size && out_begin < in_begin + tl.numel[i] * in_size;
    DISTOPT_CHECK(!overlap || (in_begin == out_begin && tl.lists[0].dtype == outs.dtype), op, ": outputs[", i,
                  "] partially overlaps inputs[", i, "]");
  }
  return tl;
}

}  // namespace distopt
