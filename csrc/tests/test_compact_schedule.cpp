// The CUDA compaction's schedule (store/compact_schedule.h) run on the CPU by a simulator.
//
// The kernel's tiles run as state machines on a shadow array of token ids, one step at a
// time, in an order a scheduler picks among the runnable ones. Each tile goes through the
// kernel's phases, with the header's functions:
//   start      counts its kept tokens, publishes its first look-back word; tiles start in
//              ticket order and at most `resident` run at once (the kernel's resident blocks);
//   look back  one predecessor's word per step, blocked while that word is unpublished;
//   moves      plan_tile's sequence: the tail's read (if any), then per ascending chunk a
//              read (stage the rows, publish read progress), a wait (blocked until the wait
//              rule holds) and a write, then the tail's wait and write.
// Nothing else orders the tiles, so any interleaving the GPU could produce under the
// declared waits is one the simulator can pick. The result must equal a plain stable
// compaction (what compact_cpu does: kept tokens in order, the new length, every token past
// it untouched), the look-back must give every tile the exclusive prefix of the kept counts,
// the staging must never hold more than `cap` rows, and the schedule must never deadlock.
// The same simulator with a weakened wait rule (no wait, one of the two tiles only, one
// token short) must be caught giving a wrong result in some interleaving: the checks can
// fail. A parallel-rounds mode (every runnable tile steps at once) measures the schedule's
// depth: evicting one token of a long segment must not chain the tiles one after another.
#include <gtest/gtest.h>

#include <algorithm>
#include <iostream>
#include <cstdint>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "store/compact_schedule.h"
#include "tests/store_util.h"

namespace {

namespace cs = kvcache_ext::store::compact_schedule;

// The wait rule the simulated tiles follow: the header's, or a weakened one.
enum class Rule { kExact, kNoWait, kFirstTileOnly, kLastTileOnly, kOneTokenShort };

const char* rule_name(Rule r) {
  switch (r) {
    case Rule::kExact: return "exact";
    case Rule::kNoWait: return "no wait";
    case Rule::kFirstTileOnly: return "first overlapped tile only";
    case Rule::kLastTileOnly: return "last overlapped tile only";
    case Rule::kOneTokenShort: return "overlap one token short";
  }
  return "?";
}

// How the scheduler picks among the runnable tiles.
// kRounds: every runnable tile steps once per round (all tiles started at once, the
// look-back walked as far as it can in one step); SimResult::rounds counts the rounds.
enum class Pick { kRandom, kLatestFirst, kEarliestFirst, kRounds };

struct Scenario {
  std::vector<std::vector<char>> keep;  // keep flag of every live token, by segment
  int64_t span = 1, cap = 1, resident = 1;
  bool ticket_order = true;  // tiles start in ticket order (the kernel); false: any order
  bool tail_first = true;    // plan_tile's tail; false: ascending chunks only (for contrast)
  std::string describe() const {
    std::ostringstream o;
    o << "span " << span << " cap " << cap << " resident " << resident << " lengths";
    for (const auto& k : keep) o << ' ' << k.size();
    return o.str();
  }
};

constexpr int kSlack = 3;  // ids after each segment's live tokens: never written

// Token ids: segment s, token i -> s * 1'000'000 + i (unique over the store).
int id_of(size_t s, size_t i) { return static_cast<int>(s * 1000000 + i); }

std::vector<std::vector<int>> initial_store(const Scenario& sc) {
  std::vector<std::vector<int>> data(sc.keep.size());
  for (size_t s = 0; s < sc.keep.size(); ++s) {
    for (size_t i = 0; i < sc.keep[s].size() + kSlack; ++i) data[s].push_back(id_of(s, i));
  }
  return data;
}

// Plain stable compaction: kept ids in order, then the old ids past the new length.
std::vector<std::vector<int>> reference_compact(const Scenario& sc, std::vector<int64_t>& new_len) {
  std::vector<std::vector<int>> data = initial_store(sc);
  new_len.assign(sc.keep.size(), 0);
  for (size_t s = 0; s < sc.keep.size(); ++s) {
    int64_t kept = 0;
    for (size_t i = 0; i < sc.keep[s].size(); ++i) {
      if (sc.keep[s][i]) data[s][kept++] = id_of(s, i);
    }
    new_len[s] = kept;
  }
  return data;
}

struct SimResult {
  bool deadlock = false;
  std::string failure;  // a broken invariant (always a defect, whatever the rule)
  std::vector<std::vector<int>> data;
  std::vector<int64_t> new_len;
  int64_t max_waited_tiles = 0;  // most earlier tiles one write waited for
  int64_t tails = 0;             // tiles that read a tail first
  int64_t rounds = 0;            // Pick::kRounds: parallel rounds to the end
};

class Simulator {
 public:
  Simulator(const Scenario& sc, Rule rule, Pick pick, uint32_t seed)
      : sc_(sc), rule_(rule), pick_(pick), rng_(seed) {
    result_.data = initial_store(sc);
    result_.new_len.assign(sc.keep.size(), -1);
    // Tickets in (segment, tile) order, as compact_plan_kernel numbers them.
    for (size_t s = 0; s < sc.keep.size(); ++s) {
      const int64_t n = static_cast<int64_t>(sc.keep[s].size());
      if (n == 0) result_.new_len[s] = 0;  // no tile: the length stays 0
      for (int64_t c = 0; c < cs::tiles_of(n, sc.span); ++c) {
        Tile t;
        t.seg = s;
        t.c = c;
        t.n = n;
        t.first_token = c * sc.span;
        t.rows = cs::tile_rows(n, sc.span, c);
        tiles_.push_back(t);
      }
    }
    status_.assign(tiles_.size(), 0);  // zeroed: kInvalid
    progress_.assign(tiles_.size(), 0);
  }

  SimResult run() {
    for (;;) {
      std::vector<size_t> runnable;
      bool all_done = true;
      for (size_t t = 0; t < tiles_.size(); ++t) {
        if (tiles_[t].phase != Phase::kDone) all_done = false;
        if (can_run(t)) runnable.push_back(t);
      }
      if (all_done) break;
      if (runnable.empty()) {
        result_.deadlock = true;
        break;
      }
      if (pick_ == Pick::kRounds) {
        ++result_.rounds;
        for (size_t t : runnable) step(t);  // runnable when the round began: one step each
      } else {
        size_t t = runnable.front();
        if (pick_ == Pick::kLatestFirst) t = runnable.back();
        if (pick_ == Pick::kRandom) t = runnable[rng_() % runnable.size()];
        step(t);
      }
      if (!result_.failure.empty()) break;
    }
    return result_;
  }

 private:
  enum class Phase { kNotStarted, kLookBack, kMoves, kDone };
  // One operation of a tile's moves, on ranks [r0, r0 + count).
  struct Op {
    enum Kind { kRead, kWait, kWrite } kind;
    int64_t r0, count;
    uint32_t progress;  // kRead: the progress word published once the ranks are read
  };
  struct Tile {
    size_t seg = 0;
    int64_t c = 0, n = 0, first_token = 0, rows = 0;
    Phase phase = Phase::kNotStarted;
    int64_t tile_kept = 0;
    std::vector<int32_t> kept_local;  // local index of each kept token, by rank
    int64_t back = 1, sum = 0;        // look-back: next predecessor's distance, sum so far
    int64_t kept_before = 0;
    std::vector<Op> ops;              // the moves, in order
    size_t next_op = 0;
    std::vector<int> staged;          // by rank: the id read (-1: not read)
    int64_t staged_rows = 0;          // rows of staging in use
  };

  void fail(size_t t, const std::string& what) {
    std::ostringstream o;
    o << "tile " << t << " (segment " << tiles_[t].seg << ", local " << tiles_[t].c << "): " << what;
    result_.failure = o.str();
  }

  // Whether the write of ranks [r0, r0 + count) of tile t may go ahead under the rule.
  bool may_write(size_t t, const Op& op) const {
    const Tile& tile = tiles_[t];
    const int64_t dst_begin = tile.kept_before + op.r0, dst_end = dst_begin + op.count;
    const cs::TileRange r = cs::overlapped_tiles(tile.c, sc_.span, dst_begin, dst_end);
    std::vector<int64_t> waited;
    for (int64_t d = r.first; d <= r.last; ++d) waited.push_back(d);
    switch (rule_) {
      case Rule::kExact: case Rule::kOneTokenShort: break;
      case Rule::kNoWait: waited.clear(); break;
      case Rule::kFirstTileOnly: if (waited.size() > 1) waited.resize(1); break;
      case Rule::kLastTileOnly: if (waited.size() > 1) waited.erase(waited.begin()); break;
    }
    const int64_t end = rule_ == Rule::kOneTokenShort ? dst_end - 1 : dst_end;
    for (int64_t d : waited) {
      const size_t ticket = t - static_cast<size_t>(tile.c - d);
      if (!cs::may_write(progress_[ticket], d, sc_.span, dst_begin, end)) return false;
    }
    return true;
  }

  bool can_run(size_t t) const {
    const Tile& tile = tiles_[t];
    switch (tile.phase) {
      case Phase::kNotStarted:  // tickets are taken in order, by resident blocks only
        if (pick_ == Pick::kRounds) return true;
        return (!sc_.ticket_order || t == next_ticket_) && running_ < sc_.resident;
      case Phase::kLookBack:
        return tile.c == 0 || cs::status_of(status_[t - static_cast<size_t>(tile.back)]) != cs::kInvalid;
      case Phase::kMoves: {
        const Op& op = tile.ops[tile.next_op];
        return op.kind != Op::kWait || may_write(t, op);
      }
      case Phase::kDone: return false;
    }
    return false;
  }

  // Progress only grows: the prefix read and the tail read never shrink.
  void publish_progress(size_t t, uint32_t word) {
    const uint32_t old = progress_[t];
    if ((word & 0xffffu) < (old & 0xffffu) || (word >> 16) < (old >> 16)) fail(t, "read progress went down");
    progress_[t] = word;
  }

  // The moves of a tile after its look-back, as the kernel runs them.
  void plan_moves(size_t t) {
    Tile& tile = tiles_[t];
    const int64_t span = sc_.span;
    if (cs::tile_moves_nothing(tile.c, span, tile.rows, tile.kept_before, tile.tile_kept)) {
      publish_progress(t, cs::progress_word(span, span, span));
      finish(t);
      return;
    }
    cs::TilePlan tp = cs::plan_tile(tile.kept_local.data(), tile.tile_kept, tile.c, span,
                                    tile.kept_before, sc_.cap);
    if (!sc_.tail_first) tp = cs::TilePlan{tile.tile_kept, span, sc_.cap};
    const int64_t tail = tile.tile_kept - tp.tail_rank;
    if (tp.tail_from < span) {
      ++result_.tails;
      tile.ops.push_back({Op::kRead, tp.tail_rank, tail, cs::progress_word(0, tp.tail_from, span)});
    }
    for (int64_t m0 = 0; m0 < tp.tail_rank; m0 += tp.chunk) {
      const cs::Chunk ch = cs::chunk_at(tile.kept_before, tp.tail_rank, m0, tp.chunk);
      if (ch.dst_begin != tile.kept_before + m0 || ch.dst_end != ch.dst_begin + ch.count || ch.count < 1) {
        fail(t, "chunk_at gave a wrong chunk");
      }
      const int64_t prefix = cs::read_prefix(tile.kept_local.data(), m0 + ch.count, tile.tile_kept, span);
      tile.ops.push_back({Op::kRead, m0, ch.count, cs::progress_word(prefix, tp.tail_from, span)});
      tile.ops.push_back({Op::kWait, m0, ch.count, 0});
      tile.ops.push_back({Op::kWrite, m0, ch.count, 0});
    }
    if (tail > 0) {
      tile.ops.push_back({Op::kWait, tp.tail_rank, tail, 0});
      tile.ops.push_back({Op::kWrite, tp.tail_rank, tail, 0});
    }
    tile.staged.assign(static_cast<size_t>(tile.tile_kept), -1);
    tile.next_op = 0;
    tile.phase = Phase::kMoves;
  }

  void step(size_t t) {
    Tile& tile = tiles_[t];
    const std::vector<char>& keep = sc_.keep[tile.seg];
    std::vector<int>& data = result_.data[tile.seg];
    switch (tile.phase) {
      case Phase::kNotStarted: {
        ++next_ticket_;
        ++running_;
        for (int64_t i = 0; i < tile.rows; ++i) {
          if (keep[tile.first_token + i]) tile.kept_local.push_back(static_cast<int32_t>(i));
        }
        tile.tile_kept = static_cast<int64_t>(tile.kept_local.size());
        status_[t] = cs::first_word(tile.c, tile.tile_kept);
        tile.phase = Phase::kLookBack;
        return;
      }
      case Phase::kLookBack: {
        // One predecessor per step (Pick::kRounds: as far as the published words go).
        while (tile.c > 0) {
          const uint64_t word = status_[t - static_cast<size_t>(tile.back)];
          if (cs::status_of(word) == cs::kInvalid) return;  // only after a first step
          if (cs::look_back_step(word, tile.sum)) break;
          if (++tile.back > tile.c) {
            fail(t, "look-back walked past the segment's first tile");
            return;
          }
          if (pick_ != Pick::kRounds) return;
        }
        tile.kept_before = tile.sum;
        int64_t expected = 0;  // the exclusive prefix, counted directly
        for (int64_t i = 0; i < tile.first_token; ++i) expected += keep[i] ? 1 : 0;
        if (tile.kept_before != expected) {
          fail(t, "look-back gave kept_before " + std::to_string(tile.kept_before) + ", not " +
                      std::to_string(expected));
          return;
        }
        const int64_t inclusive = tile.kept_before + tile.tile_kept;
        if (tile.c > 0) status_[t] = cs::status_word(cs::kInclusive, static_cast<uint32_t>(inclusive));
        if (tile.first_token + tile.rows == tile.n) result_.new_len[tile.seg] = inclusive;
        plan_moves(t);
        return;
      }
      case Phase::kMoves: {
        const Op op = tile.ops[tile.next_op++];
        for (int64_t m = op.r0; m < op.r0 + op.count; ++m) {
          const int64_t src = tile.first_token + tile.kept_local[m];
          const int64_t dst = tile.kept_before + m;
          if (dst > src) fail(t, "a token would move up");
          if (op.kind == Op::kRead && dst != src) tile.staged[m] = data[src];
          if (op.kind == Op::kWrite && dst != src) {
            if (tile.staged[m] < 0) fail(t, "a rank written before it was read");
            data[dst] = tile.staged[m];
          }
        }
        if (op.kind == Op::kRead) {
          tile.staged_rows += op.count;
          if (tile.staged_rows > sc_.cap) fail(t, "the staging holds more than cap rows");
          publish_progress(t, op.progress);
        }
        if (op.kind == Op::kWrite) tile.staged_rows -= op.count;
        if (op.kind == Op::kWait) {
          const cs::TileRange r = cs::overlapped_tiles(tile.c, sc_.span, tile.kept_before + op.r0,
                                                       tile.kept_before + op.r0 + op.count);
          const int64_t waited = std::max<int64_t>(0, r.last - r.first + 1);
          result_.max_waited_tiles = std::max(result_.max_waited_tiles, waited);
          if (waited > 2 || (waited > 0 && (r.first < 0 || r.last >= tile.c))) {
            fail(t, "the wait rule names tiles it must not");
          }
        }
        if (tile.next_op == tile.ops.size()) finish(t);
        return;
      }
      case Phase::kDone: return;
    }
  }

  void finish(size_t t) {
    tiles_[t].phase = Phase::kDone;
    --running_;
  }

  const Scenario& sc_;
  Rule rule_;
  Pick pick_;
  std::mt19937 rng_;
  std::vector<Tile> tiles_;
  std::vector<uint64_t> status_;
  std::vector<uint32_t> progress_;
  size_t next_ticket_ = 0;
  int64_t running_ = 0;
  SimResult result_;
};

// "" when the simulated run equals the reference, else what differs.
std::string run_and_compare(const Scenario& sc, Rule rule, Pick pick, uint32_t seed,
                            int64_t* max_waited = nullptr, int64_t* tails = nullptr) {
  const SimResult got = Simulator(sc, rule, pick, seed).run();
  if (max_waited) *max_waited = std::max(*max_waited, got.max_waited_tiles);
  if (tails) *tails += got.tails;
  if (got.deadlock) return "deadlock";
  if (!got.failure.empty()) return got.failure;
  std::vector<int64_t> want_len;
  const std::vector<std::vector<int>> want = reference_compact(sc, want_len);
  for (size_t s = 0; s < want.size(); ++s) {
    if (got.new_len[s] != want_len[s]) {
      return "segment " + std::to_string(s) + ": length " + std::to_string(got.new_len[s]) +
             ", want " + std::to_string(want_len[s]);
    }
    for (size_t i = 0; i < want[s].size(); ++i) {
      if (got.data[s][i] != want[s][i]) {
        return "segment " + std::to_string(s) + " token " + std::to_string(i) + ": id " +
               std::to_string(got.data[s][i]) + ", want " + std::to_string(want[s][i]);
      }
    }
  }
  return "";
}

// Random ragged stores: empty, single-token, exact multiples of the span, long segments;
// keep fractions from none to all, and the one-token eviction of H2O.
Scenario random_scenario(std::mt19937& rng) {
  auto uniform = [&](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };
  Scenario sc;
  const int64_t spans[] = {1, 2, 3, 4, 5, 8};
  sc.span = spans[uniform(0, 5)];
  sc.cap = uniform(1, sc.span + 1);  // larger than the span too: a chunk is then a whole tile
  const int64_t residents[] = {1, 2, 3, 5, 1000};
  sc.resident = residents[uniform(0, 4)];
  const int64_t segments = uniform(1, 5);
  for (int64_t s = 0; s < segments; ++s) {
    int64_t n = 0;
    switch (uniform(0, 5)) {
      case 0: n = 0; break;
      case 1: n = 1; break;
      case 2: n = sc.span * uniform(1, 4); break;
      case 3: n = uniform(2, 3 * sc.span); break;
      default: n = uniform(sc.span, 12 * sc.span + 7); break;
    }
    std::vector<char> keep(static_cast<size_t>(n));
    const int mode = static_cast<int>(uniform(0, 6));
    const double p = mode == 0 ? 0.0 : mode == 1 ? 1.0 : mode == 2 ? 0.125 : mode == 3 ? 0.5 : 0.875;
    std::bernoulli_distribution flip(p);
    for (auto& k : keep) k = flip(rng) ? 1 : 0;
    if (mode == 6 && n > 0) {  // H2O: every token but one
      std::fill(keep.begin(), keep.end(), 1);
      keep[static_cast<size_t>(uniform(0, n - 1))] = 0;
    }
    sc.keep.push_back(std::move(keep));
  }
  return sc;
}

TEST(CompactSchedule, Tiling) {
  EXPECT_EQ(cs::tiles_of(0, 4), 0);
  EXPECT_EQ(cs::tiles_of(1, 4), 1);
  EXPECT_EQ(cs::tiles_of(8, 4), 2);
  EXPECT_EQ(cs::tiles_of(9, 4), 3);
  EXPECT_EQ(cs::tile_rows(9, 4, 2), 1);
  EXPECT_EQ(cs::tile_rows(8, 4, 1), 4);
  // Chunk rows from the staging budget: what fits, at most one per thread, at least one.
  EXPECT_EQ(cs::chunk_rows(72 * 1024, 10 * 1024, 520, 256), (62 * 1024) / 520);
  EXPECT_EQ(cs::chunk_rows(72 * 1024, 10 * 1024, 40, 256), 256);
  EXPECT_EQ(cs::chunk_rows(72 * 1024, 10 * 1024, 100000, 256), 1);
  // Span: the longest that still gives every resident block two tiles, within its bounds.
  EXPECT_EQ(cs::choose_span(32, 32768, 396, 1024, 128), 1024);     // 1024 tiles >= 792
  EXPECT_EQ(cs::choose_span(8, 32768, 396, 1024, 128), 256);       // 8 long heads, batch 1
  EXPECT_EQ(cs::choose_span(32, 4096, 396, 1024, 128), 128);
  EXPECT_EQ(cs::choose_span(1, 100, 396, 1024, 128), 128);         // never below the minimum
  EXPECT_EQ(cs::choose_span(4096, 4096, 396, 1024, 128), 1024);
  const cs::Chunk ch = cs::chunk_at(10, 7, 4, 3);
  EXPECT_EQ(ch.count, 3);
  EXPECT_EQ(ch.dst_begin, 14);
  EXPECT_EQ(ch.dst_end, 17);
  EXPECT_EQ(cs::chunk_at(10, 7, 6, 3).count, 1);
}

TEST(CompactSchedule, StatusWords) {
  const uint64_t w = cs::status_word(cs::kAggregate, 4000000000u);
  EXPECT_EQ(cs::status_of(w), cs::kAggregate);
  EXPECT_EQ(cs::value_of(w), 4000000000u);
  EXPECT_EQ(cs::status_of(0), cs::kInvalid);  // zeroed scratch reads as unpublished
  EXPECT_EQ(cs::status_of(cs::first_word(0, 5)), cs::kInclusive);
  EXPECT_EQ(cs::status_of(cs::first_word(3, 5)), cs::kAggregate);
  int64_t sum = 0;
  EXPECT_FALSE(cs::look_back_step(cs::status_word(cs::kAggregate, 3), sum));
  EXPECT_TRUE(cs::look_back_step(cs::status_word(cs::kInclusive, 10), sum));
  EXPECT_EQ(sum, 13);
}

TEST(CompactSchedule, WaitRule) {
  // span 4: tile 3 (tokens 12..15) writing destinations [5, 9) overlaps tiles 1 and 2.
  cs::TileRange r = cs::overlapped_tiles(3, 4, 5, 9);
  EXPECT_EQ(r.first, 1);
  EXPECT_EQ(r.last, 2);
  // Tile 1 must have read its local indices [1, 4), tile 2 its local index 0.
  EXPECT_FALSE(cs::may_write(cs::progress_word(0, 4, 4), 1, 4, 5, 9));  // nothing read
  EXPECT_FALSE(cs::may_write(cs::progress_word(3, 4, 4), 1, 4, 5, 9));  // prefix [0, 3)
  EXPECT_TRUE(cs::may_write(cs::progress_word(4, 4, 4), 1, 4, 5, 9));   // prefix [0, 4)
  EXPECT_TRUE(cs::may_write(cs::progress_word(0, 1, 4), 1, 4, 5, 9));   // tail [1, 4)
  EXPECT_FALSE(cs::may_write(cs::progress_word(0, 2, 4), 1, 4, 5, 9));  // tail [2, 4)
  EXPECT_TRUE(cs::may_write(cs::progress_word(2, 2, 4), 1, 4, 5, 9));   // both: everything
  EXPECT_TRUE(cs::may_write(cs::progress_word(1, 4, 4), 2, 4, 5, 9));
  EXPECT_FALSE(cs::may_write(cs::progress_word(0, 4, 4), 2, 4, 5, 9));
  EXPECT_EQ(cs::progress_word(0, 4, 4), 0u);  // zeroed scratch reads as nothing read
  // Destinations reaching into the tile's own sources: only the earlier tile is waited for.
  r = cs::overlapped_tiles(2, 4, 6, 10);
  EXPECT_EQ(r.first, 1);
  EXPECT_EQ(r.last, 1);
  // Inside its own sources, or nothing written: no wait at all.
  r = cs::overlapped_tiles(2, 4, 8, 12);
  EXPECT_LT(r.last, r.first);
  r = cs::overlapped_tiles(2, 4, 3, 3);
  EXPECT_LT(r.last, r.first);
  EXPECT_TRUE(cs::tile_moves_nothing(2, 4, 4, 8, 4));   // all kept, nothing before dropped
  EXPECT_TRUE(cs::tile_moves_nothing(2, 4, 4, 5, 0));   // keeps nothing
  EXPECT_FALSE(cs::tile_moves_nothing(2, 4, 4, 7, 4));  // all kept but shifted down
  const int32_t kept_local[] = {1, 3};
  EXPECT_EQ(cs::read_prefix(kept_local, 1, 2, 4), 3);
  EXPECT_EQ(cs::read_prefix(kept_local, 2, 2, 4), 4);
  EXPECT_EQ(cs::first_rank_at(kept_local, 2, 0), 0);
  EXPECT_EQ(cs::first_rank_at(kept_local, 2, 2), 1);
  EXPECT_EQ(cs::first_rank_at(kept_local, 2, 3), 1);
  EXPECT_EQ(cs::first_rank_at(kept_local, 2, 4), 2);
}

TEST(CompactSchedule, TilePlan) {
  // Tile 5 of span 8 keeping all 8 after one eviction earlier: inclusive 47, so only its
  // last token (local 7) is exposed; with cap 4 it is the tail, chunks of 3 below it.
  const int32_t all[] = {0, 1, 2, 3, 4, 5, 6, 7};
  cs::TilePlan tp = cs::plan_tile(all, 8, 5, 8, 39, 4);
  EXPECT_EQ(tp.tail_rank, 7);
  EXPECT_EQ(tp.tail_from, 7);
  EXPECT_EQ(tp.chunk, 3);
  // Half of the segment evicted before: every token exposed, no tail.
  tp = cs::plan_tile(all, 8, 5, 8, 20, 4);
  EXPECT_EQ(tp.tail_rank, 8);
  EXPECT_EQ(tp.tail_from, 8);
  EXPECT_EQ(tp.chunk, 4);
  // One chunk holds the whole tile: no tail needed.
  tp = cs::plan_tile(all, 8, 5, 8, 39, 8);
  EXPECT_EQ(tp.tail_rank, 8);
  // Exposed but none kept there (the tile's top tokens evicted): an empty tail.
  const int32_t low[] = {0, 1, 2, 3, 4};
  tp = cs::plan_tile(low, 5, 5, 8, 39, 4);  // inclusive 44: local 4 and up exposed
  EXPECT_EQ(tp.tail_rank, 4);
  EXPECT_EQ(tp.tail_from, 4);
  EXPECT_EQ(tp.chunk, 3);
}

// The exact rule gives the reference result in every interleaving tried, never deadlocks,
// and never waits for more than two tiles.
TEST(CompactSchedule, SimulatorMatchesReference) {
  std::mt19937 rng(20261127);
  int64_t max_waited = 0, tails = 0;
  for (int trial = 0; trial < 600; ++trial) {
    const Scenario sc = random_scenario(rng);
    for (Pick pick : {Pick::kRandom, Pick::kLatestFirst, Pick::kEarliestFirst, Pick::kRounds}) {
      const uint32_t seed = static_cast<uint32_t>(rng());
      const std::string diff = run_and_compare(sc, Rule::kExact, pick, seed, &max_waited, &tails);
      ASSERT_EQ(diff, "") << "trial " << trial << " pick " << static_cast<int>(pick) << " seed "
                          << seed << ": " << sc.describe();
    }
  }
  // The scenarios reach the two-tile case (else the rule's second wait would go untested)
  // and tiles that read a tail first.
  EXPECT_EQ(max_waited, 2);
  EXPECT_GT(tails, 0);
}

// Kernel-sized tiles: span 1024, chunks of 120 rows (bf16 head_dim 128 in 72 KiB), long and
// ragged segments at keep 0.125 and 0.5, 396 resident blocks.
TEST(CompactSchedule, SimulatorKernelSizes) {
  std::mt19937 rng(42);
  for (double p : {0.125, 0.5}) {
    Scenario sc;
    sc.span = 1024;
    sc.cap = 120;
    sc.resident = 396;
    std::bernoulli_distribution flip(p);
    for (int64_t n : {32768, 1, 0, 5000, 1024, 20000}) {
      std::vector<char> keep(static_cast<size_t>(n));
      for (auto& k : keep) k = flip(rng) ? 1 : 0;
      sc.keep.push_back(std::move(keep));
    }
    for (Pick pick : {Pick::kRandom, Pick::kLatestFirst}) {
      EXPECT_EQ(run_and_compare(sc, Rule::kExact, pick, 7), "") << "keep " << p;
    }
  }
}

// A weakened rule is caught: some interleaving of some scenario gives a wrong store.
TEST(CompactSchedule, WeakenedRulesAreCaught) {
  for (Rule rule : {Rule::kNoWait, Rule::kFirstTileOnly, Rule::kLastTileOnly, Rule::kOneTokenShort}) {
    std::mt19937 rng(7);
    int caught = 0;
    for (int trial = 0; trial < 600 && caught == 0; ++trial) {
      const Scenario sc = random_scenario(rng);
      for (Pick pick : {Pick::kRandom, Pick::kLatestFirst}) {
        const std::string diff = run_and_compare(sc, rule, pick, static_cast<uint32_t>(rng()));
        ASSERT_NE(diff, "deadlock") << rule_name(rule);  // fewer waits cannot deadlock
        if (!diff.empty()) ++caught;
      }
    }
    EXPECT_GT(caught, 0) << "the simulator did not catch the rule: " << rule_name(rule);
  }
}

// Why tiles are taken by ticket: started in any order (as blockIdx order would allow) by
// few resident blocks, a tile whose predecessors never started waits on them forever. The
// simulator reports the deadlock (so its "no deadlock" check can fail); in ticket order the
// same store completes.
TEST(CompactSchedule, TicketOrderPreventsDeadlock) {
  Scenario sc;
  sc.span = 2;
  sc.cap = 2;
  sc.resident = 1;
  sc.keep = {{1, 0, 1, 1, 0, 1}};
  EXPECT_EQ(run_and_compare(sc, Rule::kExact, Pick::kLatestFirst, 1), "");
  sc.ticket_order = false;
  EXPECT_EQ(run_and_compare(sc, Rule::kExact, Pick::kLatestFirst, 1), "deadlock");
}

// Evicting one token of a long segment shifts every later token down by one: each tile's
// destinations start under its predecessor's last token. With the tail read first the
// tiles move in parallel (a few rounds, however many tiles); read in ascending chunks only,
// each tile would wait for its predecessor's last chunk, a chain through the segment.
TEST(CompactSchedule, OneEvictionDoesNotChainTiles) {
  Scenario sc;
  sc.span = 8;
  sc.cap = 4;
  sc.resident = 1000;
  std::vector<char> keep(64 * 8, 1);
  keep[3] = 0;
  sc.keep = {keep};
  const SimResult parallel = Simulator(sc, Rule::kExact, Pick::kRounds, 1).run();
  ASSERT_FALSE(parallel.deadlock);
  ASSERT_EQ(parallel.failure, "");
  EXPECT_EQ(parallel.tails, 64);  // every tile: its top token is the one exposed
  EXPECT_LT(parallel.rounds, 16) << "tiles waited for one another in a chain";
  std::cout << "one eviction, 64 tiles: " << parallel.rounds << " parallel rounds with the tail first, ";
  sc.tail_first = false;
  const SimResult chained = Simulator(sc, Rule::kExact, Pick::kRounds, 1).run();
  ASSERT_FALSE(chained.deadlock);
  EXPECT_GT(chained.rounds, 64) << "the contrast case no longer chains: the measure is void";
  std::cout << chained.rounds << " without\n";
  EXPECT_EQ(run_and_compare(sc, Rule::kExact, Pick::kRandom, 3), "");  // still correct
}

// ---------------------------------------------------------------------------------------
// The store_compact op itself (compact_cpu, and compact_cuda in the Cuda twins) on stores
// shaped so that the CUDA kernel's schedule is exercised: segments of many tiles, rows so
// wide that a tile needs several chunks (fp32 head_dim 1024: 7 rows of staging) and tails,
// ragged lengths (0, 1, one tile, tile + 1). Every segment has its own keep pattern:
// random at 0.5 and 0.125, one eviction, none, all, the first token only dropped, the
// first half kept. Checked against the contents before the compaction: kept tokens in
// order (K, V, pos and scores bit for bit), the new lengths, and the tokens past the new
// length untouched (what compact_cpu leaves there).

struct CompactCase {
  at::ScalarType dtype;
  int64_t D, C, P;
  std::vector<int64_t> lens;
};

void compact_matches_reference(const at::Device& device, const CompactCase& cc, uint32_t seed) {
  std::mt19937 rng(seed);
  const int64_t S = static_cast<int64_t>(cc.lens.size());
  const int64_t n_max = *std::max_element(cc.lens.begin(), cc.lens.end());
  const at::Tensor like = at::empty({0}, at::TensorOptions().dtype(cc.dtype).device(device));
  kvtest::OpStore st(1, S, cc.D, cc.C, like, cc.P);
  std::vector<bool> valid_flags;
  for (int64_t s = 0; s < S; ++s) {
    for (int64_t i = 0; i < n_max; ++i) valid_flags.push_back(i < cc.lens[s]);
  }
  const at::Tensor valid = kvtest::from_bools(valid_flags).view({1, S, n_max});
  const at::Tensor k = kvtest::random_normal({1, S, n_max, cc.D}, cc.dtype, rng);
  const at::Tensor v = kvtest::random_normal({1, S, n_max, cc.D}, cc.dtype, rng);
  const at::Tensor pos = at::arange(n_max, at::TensorOptions().dtype(at::kInt)).view({1, n_max});
  st.append(k.to(device), v.to(device), pos.to(device), valid.to(device));
  if (cc.C > 0) st.set_scores(kvtest::random_normal({st.capacity(), cc.C}, at::kFloat, rng).to(device));
  ASSERT_EQ(std::vector<int32_t>(cc.lens.begin(), cc.lens.end()), st.len_host());

  const std::vector<std::vector<int64_t>> slots = kvtest::live_slots(st);
  const at::Tensor before[4] = {kvtest::host(st.k()), kvtest::host(st.v()), kvtest::host(st.pos()),
                                kvtest::host(st.scores())};
  // Flags of slots holding no live token are random: the op must ignore them.
  at::Tensor keep = kvtest::random_mask({st.capacity()}, 0.5, rng);
  bool* flag = keep.data_ptr<bool>();
  std::vector<int64_t> want_slot, got_slot;  // kept token j of s: from want_slot to got_slot
  std::vector<int32_t> want_len;
  for (int64_t s = 0; s < S; ++s) {
    const int64_t n = cc.lens[s];
    const int pattern = static_cast<int>(s % 7);
    const int64_t evicted = n > 0 ? kvtest::uniform_int(rng, 0, n - 1) : 0;
    std::bernoulli_distribution coin(pattern == 1 ? 0.125 : 0.5);
    int64_t kept = 0;
    for (int64_t i = 0; i < n; ++i) {
      bool k_i = coin(rng);
      if (pattern == 2) k_i = i != evicted;
      if (pattern == 3) k_i = false;
      if (pattern == 4) k_i = true;
      if (pattern == 5) k_i = i != 0;
      if (pattern == 6) k_i = i < n / 2;
      flag[slots[s][i]] = k_i;
      if (k_i) {
        want_slot.push_back(slots[s][i]);
        got_slot.push_back(slots[s][kept++]);
      }
    }
    want_len.push_back(static_cast<int32_t>(kept));
    for (int64_t i = kept; i < n; ++i) {  // past the new length: untouched
      want_slot.push_back(slots[s][i]);
      got_slot.push_back(slots[s][i]);
    }
  }
  st.compact(keep.to(device));
  EXPECT_EQ(st.len_host(), want_len);
  const at::Tensor after[4] = {kvtest::host(st.k()), kvtest::host(st.v()), kvtest::host(st.pos()),
                               kvtest::host(st.scores())};
  const at::Tensor want_idx = kvtest::from_vec(want_slot, at::kLong);
  const at::Tensor got_idx = kvtest::from_vec(got_slot, at::kLong);
  const char* part_name[4] = {"K", "V", "pos", "scores"};
  for (int b = 0; b < 4; ++b) {
    EXPECT_TRUE(kvtest::BytesEqual(after[b].index_select(0, got_idx), before[b].index_select(0, want_idx)))
        << part_name[b];
  }
}

const std::vector<CompactCase>& compact_cases() {
  static const std::vector<CompactCase> cases = {
      {at::kFloat, 1024, 1, 16, {2000, 0, 1, 700, 129, 128, 1500}},
      {at::kBFloat16, 128, 2, 64, {5000, 3000, 1, 0, 256, 4097, 2500}},
      {at::kHalf, 64, 0, 4, {1000, 333, 0, 1, 1025, 4000, 77}},
  };
  return cases;
}

TEST(CompactOp, MatchesReference) {
  for (size_t i = 0; i < compact_cases().size(); ++i) {
    SCOPED_TRACE(::testing::Message() << "case " << i);
    compact_matches_reference(at::Device(at::kCPU), compact_cases()[i], 100 + static_cast<uint32_t>(i));
  }
}

#ifdef KVCACHE_EXT_WITH_CUDA
TEST(CompactOp, MatchesReferenceCuda) {
  KVTEST_REQUIRE_CUDA();
  for (size_t i = 0; i < compact_cases().size(); ++i) {
    SCOPED_TRACE(::testing::Message() << "case " << i);
    compact_matches_reference(at::Device(at::kCUDA, 0), compact_cases()[i], 100 + static_cast<uint32_t>(i));
  }
}
#endif

}  // namespace
