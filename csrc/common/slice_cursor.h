#pragma once
// A walking position in the [outer, n, row] layout of common/slices.h, for kernels that move
// several consecutive units per thread: one division to start (at unit u), then one increment per
// unit, carrying into the next row (and the next outer index) without dividing again. Used by the
// CUDA slice kernels (csrc/cuda/slices.cu) where a thread stores one 16-byte vector of the compact
// layout but the rows are shorter or less aligned than that (the 36-byte rows of a 3x3 conv sliced
// along its input channels).
#include <cstdint>

#include "common/macros.h"
#include "common/slices.h"

namespace ist {

// Unit u of a layout [outer, n, row_units] is (o, k, c); `wide` picks 64-bit division (u >= 2^31)
// over the FastDivs of row_units and n.
struct RowCursor {
  int64_t o, k, c;

  IST_HD RowCursor(int64_t u, int64_t row_units, int64_t n, const FastDiv& row_div, const FastDiv& n_div,
                   bool wide) {
    int64_t row;
    if (wide) {
      row = u / row_units;
      o = row / n;
    } else {
      row = fast_div(row_div, static_cast<uint32_t>(u));
      o = fast_div(n_div, static_cast<uint32_t>(row));
    }
    c = u - row * row_units;
    k = row - o * n;
  }

  // The next unit; returns whether it starts a new row (k, and maybe o, changed).
  IST_HD bool next(int64_t row_units, int64_t n) {
    if (++c < row_units) return false;
    c = 0;
    if (++k == n) {
      k = 0;
      ++o;
    }
    return true;
  }
};

}  // namespace ist
