#pragma once
// Index lists (subnetworks of neurons, paper 001 §3.1; partitions of filters and blocks): the pure
// index math, written once for the CPU kernels, the CUDA kernels and the argument checks.
// An index list names slices 0..size-1 of one tensor dimension; it is valid when every entry is in
// range and, where the op needs it (gathers whose gradients or scatters must not collide), no
// entry repeats.
#include <cstdint>

#include "common/macros.h"

namespace ist {

// 1 bit per slice, like the packed gates: bit j of uint32 word w is slice 32*w + j.
IST_HD int64_t index_bitmap_words(int64_t size) { return (size + 31) / 32; }

// Marks slice i in `bitmap`; returns whether it was already marked.
IST_HD bool index_mark(uint32_t* bitmap, int64_t i) {
  const uint32_t bit = 1u << static_cast<int>(i % 32);
  const bool seen = (bitmap[i / 32] & bit) != 0u;
  bitmap[i / 32] |= bit;
  return seen;
}

IST_HD bool index_marked(const uint32_t* bitmap, int64_t i) { return (bitmap[i / 32] >> (i % 32)) & 1u; }

// What check_indices found.
enum class IndexStatus : int { kOk = 0, kOutOfRange = 1, kDuplicate = 2 };

struct IndexCheck {
  IndexStatus status = IndexStatus::kOk;
  int64_t position = -1;  // first offending position in the list
  int64_t value = 0;      // the entry there
  int64_t first = -1;     // for a duplicate: where the value first appeared
  IST_HD bool ok() const { return status == IndexStatus::kOk; }
};

// O(n) validation of idx[0..n) against a dimension of `size` slices. `bitmap` has
// index_bitmap_words(size) words and is zeroed by the caller; on return it holds the selected
// slices (complete only when the check succeeded). When `allow_duplicates`, repeats are fine.
IST_HD IndexCheck check_indices(const int64_t* idx, int64_t n, int64_t size, uint32_t* bitmap,
                                bool allow_duplicates = false) {
  IndexCheck r;
  for (int64_t p = 0; p < n; ++p) {
    const int64_t v = idx[p];
    if (v < 0 || v >= size) {
      r.status = IndexStatus::kOutOfRange;
      r.position = p;
      r.value = v;
      return r;
    }
    if (index_mark(bitmap, v) && !allow_duplicates) {
      r.status = IndexStatus::kDuplicate;
      r.position = p;
      r.value = v;
      for (int64_t q = 0; q < p; ++q)
        if (idx[q] == v) {
          r.first = q;
          break;
        }
      return r;
    }
  }
  return r;
}

// Entry p of an optional index list: idx[p], or p itself when the list is absent (all slices).
IST_HD int64_t index_at(const int64_t* idx, int64_t p) { return idx ? idx[p] : p; }

}  // namespace ist
