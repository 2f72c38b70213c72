// The schedule of the CUDA compaction (store_cuda.cu) as plain functions, shared by the
// kernel and by the CPU schedule simulator (csrc/tests/test_compact_schedule.cpp), so that
// the rule the kernel follows is the rule the simulator checks.
//
// Compaction keeps, in order, the tokens of a segment whose keep flag is set: kept token m
// of the segment (m = 0, 1, ...) moves from its token index to token index m, in place.
// The kernel cuts every segment into tiles of `span` consecutive token indices; tile c
// holds indices [c * span, c * span + rows). Each tile
//   1. counts its kept tokens (tile_kept) and publishes the count (status word below);
//   2. learns kept_before, the kept tokens of the segment's earlier tiles, by looking back
//      at the published words of its predecessors (single-pass decoupled look-back), and
//      publishes its inclusive prefix kept_before + tile_kept;
//   3. moves its kept tokens to [kept_before, kept_before + tile_kept) through shared-memory
//      staging of `cap` rows (plan_tile): optionally the tail (its few top ranks that later
//      tiles could overwrite) read first and written last, and the other ranks in ascending
//      chunks: read the chunk, publish what the tile has read (read progress), wait (THE
//      WAIT RULE), write the chunk.
//
// Why this is safe, in token indices (every inequality below is used):
//   - kept token m (its rank in the tile) of tile c lies at index c * span + i with i >= m,
//     and kept_before <= c * span, so its destination kept_before + m <= its source: a
//     token never moves up. Destinations of distinct tokens are distinct, and the
//     destination of rank m lies strictly below the source of every rank m' > m.
//   - so tile c writes only below its inclusive prefix kept_before + tile_kept, which is
//     at most its own end: no tile writes into a later tile's sources, and a tile's chunk
//     writes land below the sources of its ranks not read yet (later chunks); the tail,
//     read first, is written after every chunk has been read.
//   - the only writes that can hit a token before it is read come from later tiles, into
//     an earlier tile's source range. One write (a chunk or the tail) covers at most
//     `span` destinations, so it overlaps the sources of at most two earlier tiles
//     (overlapped_tiles); it waits until each of them has read its kept tokens under the
//     overlap (may_write). Nothing else needs waiting for, and a tile that keeps nothing,
//     or whose tokens all stay where they are, writes nothing and waits for nothing.
// Waits go to earlier tiles of the same segment only, and a tile's reads depend only on its
// own earlier writes (staging reuse), which depend on its waits: the waits form no cycle.
// The kernel takes tiles in ticket order (segment-major), so the lowest unfinished ticket
// waits on finished tiles only and always progresses: no deadlock, however few blocks are
// resident.
#pragma once
#include <cstdint>

#include "store/paged_layout.h"  // KVCACHE_HOST_DEVICE

namespace kvcache_ext::store::compact_schedule {

// ---------------------------------------------------------------------------------------
// Tiling

// Tiles of a segment of n live tokens (0 for an empty segment).
KVCACHE_HOST_DEVICE inline int64_t tiles_of(int64_t n, int64_t span) { return (n + span - 1) / span; }

// Live tokens of tile c: min(span, n - c * span).
KVCACHE_HOST_DEVICE inline int64_t tile_rows(int64_t n, int64_t span, int64_t c) {
  const int64_t left = n - c * span;
  return left < span ? left : span;
}

// Rows of a chunk: as many rows of row_total bytes (K, V, pos and scores of a token) as fit
// in `budget` bytes of shared memory beside `fixed` bytes of bookkeeping, at most max_rows
// (one per thread), at least 1 (the caller checks that one row fits).
KVCACHE_HOST_DEVICE inline int64_t chunk_rows(int64_t budget, int64_t fixed, int64_t row_total,
                                              int64_t max_rows) {
  const int64_t fit = (budget - fixed) / row_total;
  return fit < 1 ? 1 : (fit < max_rows ? fit : max_rows);
}

// Tokens per tile: max_span, halved (down to min_span) while the segments could not give
// every one of `resident` blocks two tiles. Chosen from what the host knows without a sync:
// the most tokens a segment's page-table row holds, not the lengths.
KVCACHE_HOST_DEVICE inline int64_t choose_span(int64_t segments, int64_t most_tokens,
                                               int64_t resident, int64_t max_span,
                                               int64_t min_span) {
  int64_t span = max_span;
  while (span > min_span && segments * tiles_of(most_tokens, span) < 2 * resident) span /= 2;
  return span;
}

// A tile whose kept tokens need no copy: it keeps nothing, or every token of it is kept and
// every earlier token of the segment too (each stays where it is). Such a tile reads and
// writes nothing and waits for nobody.
KVCACHE_HOST_DEVICE inline bool tile_moves_nothing(int64_t c, int64_t span, int64_t rows,
                                                   int64_t kept_before, int64_t tile_kept) {
  return tile_kept == 0 || (tile_kept == rows && kept_before == c * span);
}

// ---------------------------------------------------------------------------------------
// Decoupled look-back: one 64-bit word per tile, its status in the high half and its value
// in the low half. Status and value are written and read as one word, so a reader that sees
// the status sees its value: no fence is needed between them.

constexpr uint32_t kInvalid = 0;    // nothing published yet (the words start zeroed)
constexpr uint32_t kAggregate = 1;  // value: the tile's own kept count
constexpr uint32_t kInclusive = 2;  // value: kept tokens of the tile and every earlier one

KVCACHE_HOST_DEVICE inline uint64_t status_word(uint32_t status, uint32_t value) {
  return (static_cast<uint64_t>(status) << 32) | value;
}
KVCACHE_HOST_DEVICE inline uint32_t status_of(uint64_t word) { return static_cast<uint32_t>(word >> 32); }
KVCACHE_HOST_DEVICE inline uint32_t value_of(uint64_t word) { return static_cast<uint32_t>(word); }

// What tile c publishes once it has counted its tokens: tile 0 knows its inclusive prefix
// at once, the others only their aggregate.
KVCACHE_HOST_DEVICE inline uint64_t first_word(int64_t c, int64_t tile_kept) {
  return status_word(c == 0 ? kInclusive : kAggregate, static_cast<uint32_t>(tile_kept));
}

// One step of the look-back, predecessors taken from the closest back: adds the published
// value of a predecessor (whose word must not be kInvalid) to `sum`; true when the walk is
// over (an inclusive prefix ends it). Tile 0 publishes an inclusive word, so a walk never
// goes past a segment's first tile.
KVCACHE_HOST_DEVICE inline bool look_back_step(uint64_t word, int64_t& sum) {
  sum += value_of(word);
  return status_of(word) == kInclusive;
}

// ---------------------------------------------------------------------------------------
// How a tile moves its kept tokens (after the look-back)
//
// Later tiles write only at or above the tile's inclusive prefix kept_before + tile_kept:
// the tile's kept tokens there (its "exposed" tokens, the top ranks) are the only ones
// another tile can overwrite; the others are overwritten by the tile itself only, after it
// has read them. Ascending chunks read the exposed tokens last, so a successor whose
// destinations start there would wait for the tile's last chunk, which waits for the
// tile's own predecessor in turn: a chain of every tile's chunks (a whole segment shifted
// by one token, as evicting one token per step does). So when the exposed tokens are few
// (at most half a chunk) and the tile needs several chunks, they are read first into
// their own staging rows (the tail) and written last; the other ranks go in ascending
// chunks of the remaining rows. Successors then wait for the tail's read only.

struct TilePlan {
  int64_t tail_rank;  // ranks [tail_rank, tile_kept) are the tail (tile_kept: no tail)
  int64_t tail_from;  // reading the tail covers local indices [tail_from, span) (span: none)
  int64_t chunk;      // rows per ascending chunk
};

// First rank whose local index is >= local (kept_local is increasing): binary search.
KVCACHE_HOST_DEVICE inline int64_t first_rank_at(const int32_t* kept_local, int64_t tile_kept,
                                                 int64_t local) {
  int64_t lo = 0, hi = tile_kept;
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    if (kept_local[mid] < local) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo;
}

KVCACHE_HOST_DEVICE inline TilePlan plan_tile(const int32_t* kept_local, int64_t tile_kept,
                                              int64_t c, int64_t span, int64_t kept_before,
                                              int64_t cap) {
  int64_t from = kept_before + tile_kept - c * span;  // local index of the inclusive prefix
  from = from < 0 ? 0 : (from > span ? span : from);
  const int64_t tail_rank = first_rank_at(kept_local, tile_kept, from);
  const int64_t exposed = tile_kept - tail_rank;
  if (tile_kept > cap && 2 * exposed <= cap) return TilePlan{tail_rank, from, cap - exposed};
  return TilePlan{tile_kept, span, cap};
}

// The chunk of ranks that starts at rank m0, below rank `end` (the tail's first rank, or
// tile_kept): ranks [m0, m0 + count), moved to token indices [dst_begin, dst_end) =
// kept_before + [m0, m0 + count).
struct Chunk {
  int64_t count, dst_begin, dst_end;
};

KVCACHE_HOST_DEVICE inline Chunk chunk_at(int64_t kept_before, int64_t end, int64_t m0,
                                          int64_t rows) {
  const int64_t count = end - m0 < rows ? end - m0 : rows;
  return Chunk{count, kept_before + m0, kept_before + m0 + count};
}

// ---------------------------------------------------------------------------------------
// Read progress: one 32-bit word per tile, published after each read phase. The tile has
// read every kept token whose local index is below `prefix` and every one at or above
// `tail_from`. Stored as prefix | (span - tail_from) << 16 so that the zeroed word means
// "nothing read" (span < 2^16).

KVCACHE_HOST_DEVICE inline uint32_t progress_word(int64_t prefix, int64_t tail_from, int64_t span) {
  return static_cast<uint32_t>(prefix) | (static_cast<uint32_t>(span - tail_from) << 16);
}

// The prefix a tile has read once its ascending chunks have reached rank next_rank: the
// local index of that token (every kept token below it has been read), or `span` once
// every rank is read (or when the tile moves nothing: it reads nothing and no one waits).
KVCACHE_HOST_DEVICE inline int64_t read_prefix(const int32_t* kept_local, int64_t next_rank,
                                               int64_t tile_kept, int64_t span) {
  return next_rank < tile_kept ? kept_local[next_rank] : span;
}

// ---------------------------------------------------------------------------------------
// THE WAIT RULE

// Earlier tiles first..last (local indices; empty when last < first) whose source ranges
// [d * span, (d + 1) * span) overlap the destination range [dst_begin, dst_end) written by
// tile c. Tile c itself is left out: its own sources under the range were read before (the
// chunk's own reads, an earlier chunk's or the tail's). With dst_end - dst_begin <= span
// the range meets at most two tiles, so last - first <= 1.
struct TileRange {
  int64_t first, last;
};

KVCACHE_HOST_DEVICE inline TileRange overlapped_tiles(int64_t c, int64_t span, int64_t dst_begin,
                                                      int64_t dst_end) {
  if (dst_end <= dst_begin) return TileRange{0, -1};
  const int64_t first = dst_begin / span;
  const int64_t last_overlapped = (dst_end - 1) / span;
  return TileRange{first, last_overlapped < c - 1 ? last_overlapped : c - 1};
}

// Whether earlier tile d, whose progress word is `word`, has read every kept token that a
// write of [dst_begin, dst_end) lands on: the local indices [a, b) of the overlap lie in
// what it has read, [0, prefix) and [tail_from, span).
KVCACHE_HOST_DEVICE inline bool may_write(uint32_t word, int64_t d, int64_t span, int64_t dst_begin,
                                          int64_t dst_end) {
  const int64_t a = dst_begin - d * span > 0 ? dst_begin - d * span : 0;
  const int64_t b = dst_end - d * span < span ? dst_end - d * span : span;
  const int64_t prefix = word & 0xffffu, tail_from = span - (word >> 16);
  return a >= b || b <= prefix || a >= tail_from || prefix >= tail_from;
}

}  // namespace kvcache_ext::store::compact_schedule
