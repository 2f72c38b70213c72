// The selection order and the radix selection shared by the CPU and CUDA top-k kernels
// (topk_cpu.cpp, topk_cuda.cu), so that both keep the same tokens and the CPU tests exercise
// the digit and threshold logic that the GPU runs.
//
// Order (larger = kept first), the same on both devices:
//   higher score first; NaN is lower than every number, -inf included (evicted first);
//   -0.0 equals +0.0; equal scores: lower position first; equal score and position: the
//   earlier candidate (segment by segment, token by token within a group).
// A candidate's key is two 32-bit ordered keys, score_key(score) then pos_key(pos), read as
// one 64-bit number (selection_key). The order among equal keys is not in the key: it is
// the candidate order, resolved after the threshold is known (Threshold::verdict).
//
// Radix selection of the rank-th largest key: digits of `bits` bits from the top. Every
// candidate still "in play" (its decided top bits equal the threshold's) counts into a
// histogram of its next digit; the bucket that holds the rank-th key becomes part of the
// threshold, and only its keys stay in play. Once the rank reaches the bucket's count
// (every key in play is kept) the threshold is `settled` early; otherwise after the last
// digit the keys in play are all equal and the first `rank` of them in candidate order are
// kept. The CPU walks the histogram bucket by bucket (descend_serial); the GPU sums the
// team's histograms and finds the bucket with a block scan; both end in Threshold::descend.
#pragma once
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define KVCACHE_RADIX_FN __host__ __device__ __forceinline__
#else
#define KVCACHE_RADIX_FN inline
#endif

namespace kvcache_ext::select {

// Unsigned order = float order; -0.0 -> +0.0; NaN (of either sign) -> 0, below -inf
// (0x007fffff): a NaN score is the first evicted.
KVCACHE_RADIX_FN uint32_t score_key(float score) {
  if (score != score) return 0u;
  if (score == 0.0f) score = 0.0f;
  uint32_t bits;
#if defined(__CUDA_ARCH__)
  bits = __float_as_uint(score);
#else
  std::memcpy(&bits, &score, sizeof(bits));
#endif
  // Negative: flip every bit (larger magnitude = smaller); positive: set the sign bit.
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

// Lower position = larger key. Positions are int32 as the store keeps them, compared as the
// unsigned bit pattern (the same total order on both devices; stored positions are >= 0).
KVCACHE_RADIX_FN uint32_t pos_key(int32_t pos) { return 0xFFFFFFFFu - static_cast<uint32_t>(pos); }

KVCACHE_RADIX_FN uint64_t selection_key(uint32_t score_k, uint32_t pos_k) {
  return (static_cast<uint64_t>(score_k) << 32) | pos_k;
}
KVCACHE_RADIX_FN uint64_t selection_key(float score, int32_t pos) {
  return selection_key(score_key(score), pos_key(pos));
}

enum class Verdict { kDrop = 0, kKeep = 1, kTie = 2 };

// The threshold of a radix selection as its digits are decided. Start: Threshold(rank) with
// rank = how many to keep among every candidate (0 < rank; rank = count settles at once).
struct Threshold {
  uint64_t prefix = 0;    // the decided top bits of the threshold key, the rest zero
  uint64_t mask = 0;      // ones on the decided bits (kept with `decided`: verdict runs per key)
  int decided = 0;        // how many top bits are decided, 0 .. 64
  int64_t rank = 0;       // the threshold is the rank-th largest key in play (1-based)
  bool settled = false;   // every key in play is kept: no further digit is needed

  Threshold() = default;
  KVCACHE_RADIX_FN Threshold(int64_t keep, int64_t candidates)
      : rank(keep), settled(keep >= candidates) {}

  // Whether the selection still needs a histogram.
  KVCACHE_RADIX_FN bool open() const { return !settled && decided < 64 && rank > 0; }
  // The next digit: `bits` wide, or what is left of the 64.
  KVCACHE_RADIX_FN int width(int bits) const { return 64 - decided < bits ? 64 - decided : bits; }
  KVCACHE_RADIX_FN int shift(int bits) const { return 64 - decided - width(bits); }
  // Still in play: its decided bits are the threshold's.
  KVCACHE_RADIX_FN bool in_play(uint64_t key) const { return (key & mask) == prefix; }
  KVCACHE_RADIX_FN uint32_t digit(uint64_t key, int bits) const {
    return static_cast<uint32_t>(key >> shift(bits)) & ((1u << width(bits)) - 1u);
  }
  // Whether bucket b, with `above` keys in play in higher buckets and `count` in it, holds
  // the rank-th largest key. Exactly one non-empty bucket does when rank <= keys in play.
  KVCACHE_RADIX_FN bool holds_rank(int64_t above, int64_t count) const {
    return above < rank && rank <= above + count;
  }
  // Decides the next digit: the bucket that holds_rank.
  KVCACHE_RADIX_FN void descend(uint32_t bucket, int64_t above, int64_t count, int bits) {
    const int s = shift(bits);
    decided += width(bits);
    mask = ~uint64_t{0} << s;  // the bits above the next digit's
    prefix |= static_cast<uint64_t>(bucket) << s;
    rank -= above;
    settled = rank == count;
  }
  // The whole threshold at once (the CPU's partial sort ends the selection so): the keys
  // above `key` are kept, and the first `keep_equal` keys equal to it in candidate order.
  KVCACHE_RADIX_FN void decide_all(uint64_t key, int64_t keep_equal) {
    prefix = key;
    mask = ~uint64_t{0};
    decided = 64;
    rank = keep_equal;
    settled = false;
  }
  // What becomes of a key once !open(): kept, dropped, or (keys equal to the whole
  // threshold, not settled) kept when it is among the first `rank` of them in candidate order.
  KVCACHE_RADIX_FN Verdict verdict(uint64_t key) const {
    if (rank <= 0) return Verdict::kDrop;
    const uint64_t top = key & mask;
    if (top != prefix) return top > prefix ? Verdict::kKeep : Verdict::kDrop;
    return settled ? Verdict::kKeep : Verdict::kTie;
  }
};

// The CPU's (and the host tests') step: walks hist[0 .. 2^width) from the top bucket to the
// one that holds the rank-th key, then descends into it.
template <typename Count>
KVCACHE_RADIX_FN void descend_serial(Threshold& t, const Count* hist, int bits) {
  uint32_t bucket = (1u << t.width(bits)) - 1u;
  int64_t above = 0;
  while (!t.holds_rank(above, hist[bucket])) above += hist[bucket--];
  t.descend(bucket, above, hist[bucket], bits);
}

}  // namespace kvcache_ext::select

#undef KVCACHE_RADIX_FN
