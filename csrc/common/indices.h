#pragma once
// Validation of index lists: int64 positions into a dimension of length `size` (rows, columns,
// slices). Pure functions over raw host pointers, so every op that takes index lists checks them
// the same way and the messages say the same thing.
#include <cstdint>
#include <vector>

namespace ist {

// First position k with idx[k] outside [0, size), or -1 when all are in range.
inline int64_t first_out_of_range(const int64_t* idx, int64_t n, int64_t size) {
  for (int64_t k = 0; k < n; ++k)
    if (idx[k] < 0 || idx[k] >= size) return k;
  return -1;
}

// First position k whose value already appeared at an earlier position, or -1. All values must be
// in [0, size). `seen` is scratch of at least `size` entries, all zero on entry; it is zero again on
// return, so one buffer serves many lists.
inline int64_t first_duplicate(const int64_t* idx, int64_t n, int64_t size, std::vector<uint8_t>& seen) {
  if (static_cast<int64_t>(seen.size()) < size) seen.resize(size, 0);
  int64_t dup = -1;
  int64_t k = 0;
  for (; k < n; ++k) {
    if (seen[idx[k]]) {
      dup = k;
      break;
    }
    seen[idx[k]] = 1;
  }
  for (int64_t m = 0; m < k; ++m) seen[idx[m]] = 0;
  return dup;
}

// Position of the earlier occurrence of idx[dup] (dup as returned by first_duplicate).
inline int64_t earlier_occurrence(const int64_t* idx, int64_t dup) {
  for (int64_t k = 0; k < dup; ++k)
    if (idx[k] == idx[dup]) return k;
  return -1;
}

}  // namespace ist
