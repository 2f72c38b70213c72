// An environment variable that picks between two kernels of one op (KVCACHE_EXT_TC_PREFILL,
// KVCACHE_EXT_TC_DECODE): "1" the first (`on`), "0" the second (`off`), unset the default;
// any other value is refused with a ValueError naming the variable, the value and what is
// accepted. Read on every call (one getenv, no lock): the benchmarks flip a switch between
// calls to time both kernels in one process.
#pragma once
#include <c10/util/Exception.h>

#include <cstdlib>
#include <cstring>

namespace kvcache_ext {

inline bool kernel_switch(const char* name, bool default_on, const char* on, const char* off) {
  const char* flag = std::getenv(name);
  if (flag == nullptr) return default_on;
  const bool is_on = std::strcmp(flag, "1") == 0;
  // The value that leaves the default first: "0 (off) or 1 or unset (on, the default)" or the reverse.
  TORCH_CHECK_VALUE(is_on || std::strcmp(flag, "0") == 0, "the environment variable ", name, " must be ",
                    default_on ? "0 (" : "1 (", default_on ? off : on, ") or ", default_on ? "1" : "0",
                    " or unset (", default_on ? on : off, ", the default), got '", flag, "'");
  return is_on;
}

}  // namespace kvcache_ext
