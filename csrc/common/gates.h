#pragma once
// Bit-packed gates (GReLU, paper 004 §2.1): one bit per neuron, bit j of int32 word w is
// feature 32*w + j. Shared by the CPU kernels, the CUDA kernels and (mirrored in
// ist_kernels/ops/grelu/_triton.py) the Triton kernels.
#include <cstdint>

#include "common/macros.h"

namespace ist {

constexpr int kGateBits = 32;

// ceil(num_features / 32) for num_features >= 0, without overflow up to INT64_MAX.
IST_HD int64_t gate_words(int64_t num_features) {
  return num_features / kGateBits + (num_features % kGateBits != 0 ? 1 : 0);
}
IST_HD int64_t gate_word(int64_t feature) { return feature / kGateBits; }
IST_HD int gate_bit(int64_t feature) { return static_cast<int>(feature % kGateBits); }

// Is feature `f` on in a row of packed words?
IST_HD bool gate_on(const int32_t* row_words, int64_t f) {
  return (static_cast<uint32_t>(row_words[gate_word(f)]) >> gate_bit(f)) & 1u;
}

// Word `w` of a row of `num_features` flags, where on(i) tells whether feature i is on.
template <typename On>
IST_HD int32_t pack_word(int64_t w, int64_t num_features, On on) {
  uint32_t word = 0;
  const int64_t base = w * kGateBits;
  const int64_t n = num_features - base < kGateBits ? num_features - base : kGateBits;
  for (int64_t j = 0; j < n; ++j) word |= static_cast<uint32_t>(on(base + j) ? 1u : 0u) << j;
  return static_cast<int32_t>(word);
}

}  // namespace ist
