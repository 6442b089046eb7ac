// The CPU kernels' work split: the elements of all tensors of a list, numbered one after the other
// (tensor 0's, then tensor 1's, ...), are cut into ranges for parallel_for. A range may start and end
// inside a tensor or span many small ones, so few huge tensors and many small ones both spread over
// the threads; since each element's result depends only on that element, where the cuts fall
// cannot change any result.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

namespace distopt {

// offsets[i] = flat index of tensor i's first element; offsets[n] = the total.
inline std::vector<int64_t> flat_offsets(const std::vector<int64_t>& numel) {
  std::vector<int64_t> offsets(numel.size() + 1, 0);
  for (size_t i = 0; i < numel.size(); ++i) offsets[i + 1] = offsets[i] + numel[i];
  return offsets;
}

// The tensor holding flat index `b` (< offsets[n]); empty tensors are never chosen.
inline int64_t tensor_at(const std::vector<int64_t>& offsets, int64_t b) {
  return static_cast<int64_t>(std::upper_bound(offsets.begin(), offsets.end(), b) - offsets.begin()) - 1;
}

// Elements of one parallel_for range: about 0.5-1 MB of traffic, far above a thread's wake-up cost.
constexpr int64_t kGrainElements = 32 * 1024;

}  // namespace distopt
