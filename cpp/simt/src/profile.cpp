// fastinfer simt: memory-access profiler.
//
// Capture: code compiled with the profile flags (GCC's -fsanitize=thread code generation, our
// own __tsan_* callbacks in tsan_hooks.cpp instead of libtsan, and -DFASTINFER_SIMT_PROFILE,
// which makes the ptx:: wrappers and the atomics report themselves) calls on_access() for every
// load and store it executes. Accesses outside a profiled launch, to the running thread's fiber
// stack (registers / local arrays), to the emulator's own per-thread state, and to read-only
// data (the analogue of constant memory) are dropped. The rest is classified as shared memory
// (the dynamic smem buffer and the thread-local storage blocks holding static __shared__
// variables) or global memory.
//
// Grouping: an access belongs to the warp-level request (warp, call site, space, op, k) where
// k counts how many times this lane has executed this call site since the block's last
// __syncthreads (the warp reconverges there). When a barrier completes or a block ends, the
// pending requests are evaluated with the rules below and added to per-call-site counters of
// the kernel.
//
// Rules (cpp/simt/README.md has the sources):
//   global  sectors = distinct 32-byte segments the request's lanes touch; ideal = ceil(distinct
//           bytes / 32). Every touched sector also goes into the launch's read / write sets
//           (DRAM footprint: distinct sectors, a lower bound on HBM traffic).
//   shared  32 banks of 4 bytes; a request of per-lane width <= 4 bytes is one phase of 32
//           lanes, 8 bytes two phases of 16 lanes (half warps), >= 16 bytes four phases of 8
//           lanes (quarter warps). Wavefronts of a phase = the largest number of distinct 4-byte
//           words any one bank must deliver (lanes reading the same word share it: broadcast);
//           the request's wavefronts are the sum over its phases with an active lane, its ideal
//           the number of such phases.
//   ldmatrix one phase per 8x8 matrix (the 8 row addresses of lanes 8i..8i+7, 16 bytes each).
//   cp.async global side: sectors of the source; shared side: the 16-byte destination writes
//           as a 128-bit store (four phases of 8 lanes).
//   atomic  global: sectors; shared: the 32-bit rule, and lanes updating the same word serialise.
#include "internal.h"
#include "profile.h"

#include <dlfcn.h>
#include <link.h>
#include <pthread.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cxxabi.h>
#include <map>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace fastinfer::simt {
namespace prof {

bool g_on = false;
bool g_launch_on = false;
bool g_launch_whole = false;
std::vector<std::string> g_whole_names;  // profile_run_whole's name fragments
int g_sample = 1;

namespace {

enum Space : uint8_t { kGlobal = 0, kShared = 1 };

struct Range {
  uintptr_t lo, hi;
};

struct Rec {
  uint64_t a;      // address (shared side for cp.async)
  uint64_t b;      // cp.async: global source
  uint32_t idx;    // occurrence of this call site in this lane
  uint32_t size;   // bytes at a
  uint32_t bsize;  // bytes read at b (0: cp.async zero-fill)
  uint8_t lane;
};

struct SiteKey {
  uintptr_t pc;
  uint32_t warp;
  uint16_t op;  // ProfOp | sub-kind (ldmatrix: matrices << 4)
  uint8_t space;
  bool operator==(const SiteKey& o) const { return pc == o.pc && warp == o.warp && op == o.op && space == o.space; }
};
struct SiteKeyHash {
  size_t operator()(const SiteKey& k) const {
    uint64_t h = k.pc * 0x9E3779B97F4A7C15ull ^ (static_cast<uint64_t>(k.warp) << 32) ^ (k.op << 8) ^ k.space;
    return static_cast<size_t>(h ^ (h >> 29));
  }
};
struct SiteState {
  uint32_t count[32] = {};
  std::vector<Rec> recs;
};

struct LineKey {
  uintptr_t pc;
  uint16_t op;
  uint8_t space;
  bool operator<(const LineKey& o) const {
    if (pc != o.pc) return pc < o.pc;
    if (op != o.op) return op < o.op;
    return space < o.space;
  }
};
struct LineStats {
  unsigned long long requests = 0, sectors = 0, ideal_sectors = 0, wavefronts = 0, ideal_wavefronts = 0, bytes = 0;
};

struct LaunchRec {
  dim3 grid, block;
  size_t dynamic_smem = 0;
  bool executed = true, faulted = false;
  unsigned long long blocks_run = 0;
  unsigned long long blocks_storing = 0;  // blocks that wrote global memory (stores, atomics)
  unsigned long long read_sectors = 0, write_sectors = 0, union_sectors = 0;
  unsigned long long mma[4] = {0, 0, 0, 0};
};

struct KernelStats {
  std::string name;
  uintptr_t entry = 0;  // the __global__ function (named by addr2line when dladdr cannot: hidden symbols)
  std::vector<LaunchRec> launches;
  std::map<LineKey, LineStats> lines;
};

using SectorPages = std::unordered_map<uint64_t, std::array<uint64_t, 2>>;  // 4 KiB page -> 128 sector bits

std::mutex g_mutex;  // begin / end against launches from other threads
int g_mode = 0;      // 0 count, 1 launch configurations only
std::vector<KernelStats> g_kernels;
std::unordered_map<const void*, size_t> g_kernel_index;
bool g_env_checked = false;
std::string g_env_out;

// Self-test of the tests: FASTINFER_SIMT_PROFILE_WRONG_RULE=<name> (read when profiling starts)
// replaces one rule by a wrong one, so tests/test_simt_profile.py can check that each of its
// known-answer checks fails under the wrong rule. Never set it otherwise.
enum WrongRule {
  kRight = 0,
  kSector64,       // 64-byte sectors
  kBanks16,        // 16 banks
  kNoPhases,       // 64/128-bit accesses as one phase of 32 lanes
  kNoBroadcast,    // lanes reading the same word each cost a wavefront
  kLdmatrixOnePhase,  // all matrices of an ldmatrix in one phase
  kNoOccurrence,   // a warp's executions of a call site between barriers form one request
  kDramNoDedupe,   // DRAM bytes = sum of the requests' sectors (no distinct-sector sets)
  kEveryBlockStores,  // every block that ran counts as one that wrote global memory
};
int g_wrong = kRight;
int wrong_rule_from_env() {
  const char* v = getenv("FASTINFER_SIMT_PROFILE_WRONG_RULE");
  if (!v || !v[0]) return kRight;
  static const char* const names[] = {"", "sector64", "banks16", "no_phases", "no_broadcast", "ldmatrix_one_phase",
                                      "no_occurrence", "dram_no_dedupe", "every_block_stores"};
  for (int i = 1; i < static_cast<int>(sizeof names / sizeof names[0]); ++i)
    if (strcmp(v, names[i]) == 0) return i;
  fprintf(stderr, "fastinfer simt: unknown FASTINFER_SIMT_PROFILE_WRONG_RULE=%s\n", v);
  return kRight;
}
unsigned long long g_dram_nodedupe_rd = 0, g_dram_nodedupe_wr = 0;

// Per launch (launching thread only).
KernelStats* g_cur = nullptr;
LaunchRec g_launch;
Range g_smem{0, 0};
Range g_host_stack{0, 0};  // the launching OS thread's stack (launch_kernel's argument tuple lives there)
std::vector<Range> g_tls;  // thread-local storage blocks of this thread (static __shared__)
std::vector<Range> g_ro;   // read-only segments of every loaded object, sorted
std::unordered_map<SiteKey, SiteState, SiteKeyHash> g_epoch;
bool g_epoch_dirty = false;
bool g_block_stored = false;  // the running block wrote global memory
SectorPages g_rd, g_wr;

int collect_ranges(struct dl_phdr_info* info, size_t size, void*) {
  for (int i = 0; i < info->dlpi_phnum; ++i) {
    const ElfW(Phdr)& ph = info->dlpi_phdr[i];
    if (ph.p_type == PT_TLS && size >= offsetof(struct dl_phdr_info, dlpi_tls_data) + sizeof(void*) &&
        info->dlpi_tls_data != nullptr) {
      const uintptr_t lo = reinterpret_cast<uintptr_t>(info->dlpi_tls_data);
      g_tls.push_back({lo, lo + ph.p_memsz});
    } else if ((ph.p_type == PT_LOAD && !(ph.p_flags & PF_W)) || ph.p_type == PT_GNU_RELRO) {
      const uintptr_t lo = info->dlpi_addr + ph.p_vaddr;
      g_ro.push_back({lo, lo + ph.p_memsz});
    }
  }
  return 0;
}

bool in_ro(uintptr_t a) {
  auto it = std::upper_bound(g_ro.begin(), g_ro.end(), a, [](uintptr_t x, const Range& r) { return x < r.lo; });
  if (it == g_ro.begin()) return false;
  --it;
  return a < it->hi;
}

// -1: not counted; kGlobal / kShared.
int classify(uintptr_t a, const detail::FiberBuiltins* f) {
  if (a - f->stack_lo < f->stack_hi - f->stack_lo) return -1;                              // locals
  if (a - reinterpret_cast<uintptr_t>(f) < sizeof(detail::FiberBuiltins)) return -1;       // builtins
  if (a - g_host_stack.lo < g_host_stack.hi - g_host_stack.lo) return -1;                  // kernel arguments
  if (a == reinterpret_cast<uintptr_t>(&detail::tls_cur)) return -1;
  if (a - g_smem.lo < g_smem.hi - g_smem.lo) return kShared;
  for (const Range& r : g_tls)
    if (a - r.lo < r.hi - r.lo) return kShared;
  if (in_ro(a)) return -1;  // constants (source locations, tables): the constant cache on a GPU
  return kGlobal;
}

void mark(SectorPages& pages, uint64_t sector) { pages[sector >> 7][(sector >> 6) & 1] |= 1ull << (sector & 63); }

unsigned long long count_bits(const SectorPages& p) {
  unsigned long long n = 0;
  for (const auto& [k, v] : p) n += __builtin_popcountll(v[0]) + __builtin_popcountll(v[1]);
  return n;
}

unsigned long long count_union(const SectorPages& a, const SectorPages& b) {
  unsigned long long n = count_bits(a);
  for (const auto& [k, v] : b) {
    auto it = a.find(k);
    if (it == a.end()) {
      n += __builtin_popcountll(v[0]) + __builtin_popcountll(v[1]);
    } else {
      n += __builtin_popcountll(v[0] & ~it->second[0]) + __builtin_popcountll(v[1] & ~it->second[1]);
    }
  }
  return n;
}

// ---- rules ---------------------------------------------------------------------------------
thread_local std::vector<uint64_t> t_tmp;
thread_local std::vector<std::pair<uint64_t, uint64_t>> t_iv;

// Distinct 32-byte sectors of [addr, addr + size) over the lanes; ideal = ceil(distinct bytes / 32).
void global_rule(const Rec* const* r, int n, bool use_b, unsigned long long& sectors, unsigned long long& ideal,
                 unsigned long long& bytes, SectorPages* rd, SectorPages* wr) {
  t_tmp.clear();
  t_iv.clear();
  for (int i = 0; i < n; ++i) {
    const uint64_t a = use_b ? r[i]->b : r[i]->a;
    const uint32_t s = use_b ? r[i]->bsize : r[i]->size;
    if (s == 0) continue;
    bytes += s;
    const int shift = g_wrong == kSector64 ? 6 : 5;
    for (uint64_t sec = a >> shift; sec <= (a + s - 1) >> shift; ++sec) t_tmp.push_back(sec);
    t_iv.emplace_back(a, a + s);
  }
  if (t_tmp.empty()) return;
  std::sort(t_tmp.begin(), t_tmp.end());
  t_tmp.erase(std::unique(t_tmp.begin(), t_tmp.end()), t_tmp.end());
  sectors += t_tmp.size();
  if (g_wrong == kDramNoDedupe) {
    if (rd) g_dram_nodedupe_rd += t_tmp.size();
    if (wr) g_dram_nodedupe_wr += t_tmp.size();
  }
  for (uint64_t sec : t_tmp) {
    if (rd) mark(*rd, sec);
    if (wr) mark(*wr, sec);
  }
  std::sort(t_iv.begin(), t_iv.end());
  uint64_t distinct = 0, lo = t_iv[0].first, hi = t_iv[0].second;
  for (size_t i = 1; i < t_iv.size(); ++i) {
    if (t_iv[i].first > hi) {
      distinct += hi - lo;
      lo = t_iv[i].first;
      hi = t_iv[i].second;
    } else if (t_iv[i].second > hi) {
      hi = t_iv[i].second;
    }
  }
  distinct += hi - lo;
  ideal += (distinct + 31) / 32;
}

// Wavefronts of one phase: the most distinct 4-byte words any bank must deliver (>= 1). With
// `serialize`, lanes updating the same word also take one wavefront each (shared atomics).
unsigned phase_wavefronts(const Rec* const* r, int n, bool serialize) {
  t_tmp.clear();
  for (int i = 0; i < n; ++i) {
    const uint64_t a = r[i]->a;
    const uint32_t s = r[i]->size ? r[i]->size : 1;
    for (uint64_t w = a >> 2; w <= (a + s - 1) >> 2; ++w) t_tmp.push_back(w);
  }
  std::sort(t_tmp.begin(), t_tmp.end());
  unsigned same_word = 0;
  if (serialize) {
    for (size_t i = 0; i < t_tmp.size();) {
      size_t j = i;
      while (j < t_tmp.size() && t_tmp[j] == t_tmp[i]) ++j;
      same_word = std::max<unsigned>(same_word, static_cast<unsigned>(j - i));
      i = j;
    }
  }
  if (g_wrong != kNoBroadcast) t_tmp.erase(std::unique(t_tmp.begin(), t_tmp.end()), t_tmp.end());
  unsigned per_bank[32] = {};
  unsigned worst = 1;
  const uint64_t bank_mask = g_wrong == kBanks16 ? 15 : 31;
  for (uint64_t w : t_tmp) worst = std::max(worst, ++per_bank[w & bank_mask]);
  return std::max(worst, same_word);
}

// Splits the lanes into phases of `lanes_per_phase` and sums their wavefronts.
void shared_rule(const Rec* const* r, int n, int lanes_per_phase, bool serialize, unsigned long long& wavefronts,
                 unsigned long long& ideal) {
  thread_local std::vector<const Rec*> phase;
  for (int p = 0; p < 32 / lanes_per_phase; ++p) {
    phase.clear();
    for (int i = 0; i < n; ++i)
      if (r[i]->lane / lanes_per_phase == p) phase.push_back(r[i]);
    const int m = static_cast<int>(phase.size());
    if (m == 0) continue;
    wavefronts += phase_wavefronts(phase.data(), m, serialize);
    ideal += 1;
  }
}

int lanes_per_phase_for(uint32_t width) {
  if (g_wrong == kNoPhases) return 32;
  return width <= 4 ? 32 : (width <= 8 ? 16 : 8);
}

void evaluate(const SiteKey& key, const Rec* const* r, int n) {
  LineStats& st = g_cur->lines[LineKey{key.pc, key.op, key.space}];
  st.requests += 1;
  const int op = key.op & 15;
  uint32_t width = 0;
  for (int i = 0; i < n; ++i) width = std::max(width, r[i]->size);
  switch (op) {
    case detail::kProfLoad:
    case detail::kProfStore:
    case detail::kProfAtomic:
      if (key.space == kGlobal) {
        SectorPages* rd = op != detail::kProfStore ? &g_rd : nullptr;
        SectorPages* wr = op != detail::kProfLoad ? &g_wr : nullptr;
        global_rule(r, n, false, st.sectors, st.ideal_sectors, st.bytes, rd, wr);
      } else {
        for (int i = 0; i < n; ++i) st.bytes += r[i]->size;
        shared_rule(r, n, op == detail::kProfAtomic ? 32 : lanes_per_phase_for(width), op == detail::kProfAtomic,
                    st.wavefronts, st.ideal_wavefronts);
      }
      break;
    case detail::kProfLdmatrix: {
      if (g_wrong == kLdmatrixOnePhase) {
        for (int i = 0; i < n; ++i) st.bytes += r[i]->size;
        st.wavefronts += phase_wavefronts(r, n, false);
        st.ideal_wavefronts += 1;
        break;
      }
      const int num = (key.op >> 4) & 7;
      thread_local std::vector<const Rec*> phase;
      for (int m = 0; m < num; ++m) {
        phase.clear();
        for (int i = 0; i < n; ++i)
          if (r[i]->lane / 8 == m) phase.push_back(r[i]);
        const int k = static_cast<int>(phase.size());
        if (k == 0) continue;
        for (int i = 0; i < k; ++i) st.bytes += phase[i]->size;
        st.wavefronts += phase_wavefronts(phase.data(), k, false);
        st.ideal_wavefronts += 1;
      }
      break;
    }
    case detail::kProfCpAsync: {
      global_rule(r, n, true, st.sectors, st.ideal_sectors, st.bytes, &g_rd, nullptr);
      shared_rule(r, n, lanes_per_phase_for(width), false, st.wavefronts, st.ideal_wavefronts);
      break;
    }
    default:
      break;
  }
}

// ---- output --------------------------------------------------------------------------------
const char* op_name(int op, int space) {
  switch (op & 15) {
    case detail::kProfLoad: return space == kShared ? "ld.shared" : "ld.global";
    case detail::kProfStore: return space == kShared ? "st.shared" : "st.global";
    case detail::kProfAtomic: return "atomic";
    case detail::kProfLdmatrix: return "ldmatrix";
    case detail::kProfCpAsync: return "cp.async";
  }
  return "?";
}

std::string json_str(const std::string& s) {
  std::string o = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') {
      o += '\\';
      o += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char buf[8];
      snprintf(buf, sizeof buf, "\\u%04x", c);
      o += buf;
    } else {
      o += c;
    }
  }
  return o + "\"";
}

std::string module_of(uintptr_t pc, uintptr_t* offset) {
  Dl_info info;
  *offset = pc;
  if (!dladdr(reinterpret_cast<void*>(pc), &info)) return "";
  *offset = pc - reinterpret_cast<uintptr_t>(info.dli_fbase);
  char buf[4096];
  if (info.dli_fname && info.dli_fname[0] && realpath(info.dli_fname, buf)) return buf;
  const ssize_t n = readlink("/proc/self/exe", buf, sizeof buf - 1);
  if (n > 0) {
    buf[n] = 0;
    return buf;
  }
  return info.dli_fname ? info.dli_fname : "";
}

bool write_json(const char* path) {
  FILE* f = fopen(path, "w");
  if (!f) return false;
  fprintf(f, "{\"format\": \"fastinfer-simt-profile-raw\", \"version\": 1, \"mode\": \"%s\", \"kernels\": [",
          g_mode == 1 ? "launch_only" : "count");
  for (size_t ki = 0; ki < g_kernels.size(); ++ki) {
    const KernelStats& k = g_kernels[ki];
    uintptr_t entry_off = 0;
    const std::string entry_mod = module_of(k.entry, &entry_off);
    fprintf(f, "%s\n {\"name\": %s, \"module\": %s, \"offset\": %llu, \"launches\": %zu, \"records\": [",
            ki ? "," : "", json_str(k.name).c_str(), json_str(entry_mod).c_str(),
            static_cast<unsigned long long>(entry_off), k.launches.size());
    for (size_t li = 0; li < k.launches.size(); ++li) {
      const LaunchRec& l = k.launches[li];
      fprintf(f,
              "%s{\"grid\": [%u, %u, %u], \"block\": [%u, %u, %u], \"dynamic_smem\": %zu, \"executed\": %s, "
              "\"faulted\": %s, \"blocks_run\": %llu, \"blocks_storing\": %llu, \"dram_read_bytes\": %llu, \"dram_write_bytes\": %llu, "
              "\"footprint_bytes\": %llu, \"mma\": {\"m16n8k16.f16\": %llu, \"m16n8k16.bf16\": %llu, "
              "\"m16n8k32.e4m3\": %llu, \"m16n8k32.s8\": %llu}}",
              li ? ", " : "", l.grid.x, l.grid.y, l.grid.z, l.block.x, l.block.y, l.block.z, l.dynamic_smem,
              l.executed ? "true" : "false", l.faulted ? "true" : "false", l.blocks_run, l.blocks_storing, 32 * l.read_sectors,
              32 * l.write_sectors, 32 * l.union_sectors, l.mma[0], l.mma[1], l.mma[2], l.mma[3]);
    }
    fprintf(f, "], \"sites\": [");
    size_t si = 0;
    for (const auto& [key, st] : k.lines) {
      uintptr_t off = 0;
      const std::string mod = module_of(key.pc, &off);
      fprintf(f,
              "%s\n  {\"module\": %s, \"offset\": %llu, \"op\": \"%s\", \"space\": \"%s\", \"matrices\": %d, "
              "\"requests\": %llu, \"sectors\": %llu, \"ideal_sectors\": %llu, \"wavefronts\": %llu, "
              "\"ideal_wavefronts\": %llu, \"bytes\": %llu}",
              si++ ? "," : "", json_str(mod).c_str(), static_cast<unsigned long long>(off), op_name(key.op, key.space),
              key.space == kShared ? "shared" : "global",
              (key.op & 15) == detail::kProfLdmatrix ? (key.op >> 4) & 7 : 0, st.requests, st.sectors,
              st.ideal_sectors, st.wavefronts, st.ideal_wavefronts, st.bytes);
    }
    fprintf(f, "]}");
  }
  fprintf(f, "\n]}\n");
  return fclose(f) == 0;
}

void reset() {
  g_kernels.clear();
  g_kernel_index.clear();
}

void write_env_profile() {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (!g_env_out.empty() && g_on) {
    if (!write_json(g_env_out.c_str())) fprintf(stderr, "fastinfer simt: cannot write %s\n", g_env_out.c_str());
  }
}

// FASTINFER_SIMT_PROFILE_OUT=path: profile the whole program, write the data at exit.
void check_env() {
  if (g_env_checked) return;
  g_env_checked = true;
  const char* out = getenv("FASTINFER_SIMT_PROFILE_OUT");
  if (out && out[0]) {
    g_env_out = out;
    g_on = true;
    g_mode = 0;
    g_wrong = wrong_rule_from_env();
    atexit(write_env_profile);
  }
}

}  // namespace

bool launch_begin(const void* kernel, dim3 grid, dim3 block, size_t dynamic_smem, const unsigned char* smem) {
  std::lock_guard<std::mutex> lock(g_mutex);
  check_env();
  g_launch_on = false;
  if (!g_on) return false;
  auto it = g_kernel_index.find(kernel);
  if (it == g_kernel_index.end()) {
    it = g_kernel_index.emplace(kernel, g_kernels.size()).first;
    g_kernels.push_back(KernelStats{internal::kernel_name(kernel), reinterpret_cast<uintptr_t>(kernel), {}, {}});
  }
  g_cur = &g_kernels[it->second];
  g_launch_whole = false;
  for (const std::string& fragment : g_whole_names)
    if (g_cur->name.find(fragment) != std::string::npos) g_launch_whole = true;
  g_launch = LaunchRec{};
  g_block_stored = false;
  g_launch.grid = grid;
  g_launch.block = block;
  g_launch.dynamic_smem = dynamic_smem;
  if (g_mode == 1) {
    g_launch.executed = false;
    g_cur->launches.push_back(g_launch);
    g_cur = nullptr;
    return true;
  }
  g_smem = smem ? Range{reinterpret_cast<uintptr_t>(smem), reinterpret_cast<uintptr_t>(smem) + dynamic_smem}
                : Range{0, 0};
  g_host_stack = Range{0, 0};
  pthread_attr_t attr;
  if (pthread_getattr_np(pthread_self(), &attr) == 0) {
    void* lo = nullptr;
    size_t sz = 0;
    if (pthread_attr_getstack(&attr, &lo, &sz) == 0)
      g_host_stack = Range{reinterpret_cast<uintptr_t>(lo), reinterpret_cast<uintptr_t>(lo) + sz};
    pthread_attr_destroy(&attr);
  }
  g_tls.clear();
  g_ro.clear();
  dl_iterate_phdr(collect_ranges, nullptr);
  std::sort(g_ro.begin(), g_ro.end(), [](const Range& a, const Range& b) { return a.lo < b.lo; });
  g_rd.clear();
  g_wr.clear();
  g_epoch_dirty = false;
  g_launch_on = true;
  return false;
}

void on_access(uintptr_t site, int op, const void* addr, unsigned size, const void* addr2, unsigned size2) {
  const detail::FiberBuiltins* f = detail::tls_cur;
  if (f == nullptr || !g_launch_on) return;
  int space;
  const uintptr_t a = reinterpret_cast<uintptr_t>(addr);
  if ((op & 15) == detail::kProfCpAsync || (op & 15) == detail::kProfLdmatrix) {
    space = kShared;
  } else {
    space = classify(a, f);
    if (space < 0) return;
  }
  if (space == kGlobal && ((op & 15) == detail::kProfStore || (op & 15) == detail::kProfAtomic)) g_block_stored = true;
  SiteState& s = g_epoch[SiteKey{site, f->warp, static_cast<uint16_t>(op), static_cast<uint8_t>(space)}];
  const unsigned lane = f->lane;
  const uint32_t idx = g_wrong == kNoOccurrence ? 0 : s.count[lane]++;
  if (g_wrong == kNoOccurrence) s.count[lane] = 1;
  s.recs.push_back(Rec{a, reinterpret_cast<uint64_t>(addr2), idx, size, size2, static_cast<uint8_t>(lane)});
  g_epoch_dirty = true;
}

void epoch_end() {
  if (!g_launch_on || !g_epoch_dirty) return;
  std::vector<const Rec*> order;
  std::vector<uint32_t> start;
  for (auto& [key, s] : g_epoch) {
    if (s.recs.empty()) continue;
    uint32_t groups = 0;
    for (uint32_t c : s.count) groups = std::max(groups, c);
    // counting sort of the records by occurrence index
    start.assign(groups + 1, 0);
    for (const Rec& r : s.recs) ++start[r.idx + 1];
    for (uint32_t i = 0; i < groups; ++i) start[i + 1] += start[i];
    order.resize(s.recs.size());
    std::vector<uint32_t> fill(start.begin(), start.end() - 1);
    for (const Rec& r : s.recs) order[fill[r.idx]++] = &r;
    for (uint32_t g = 0; g < groups; ++g) {
      const int n = static_cast<int>(start[g + 1] - start[g]);
      if (n > 0) evaluate(key, order.data() + start[g], n);
    }
    s.recs.clear();
    std::fill(std::begin(s.count), std::end(s.count), 0u);
  }
  g_epoch_dirty = false;
}

void block_end() {
  if (!g_launch_on) return;
  epoch_end();
  if (g_block_stored || g_wrong == kEveryBlockStores) ++g_launch.blocks_storing;
  g_block_stored = false;
}

void launch_end(bool faulted, unsigned long long blocks_run) {
  if (!g_launch_on) return;
  epoch_end();
  g_launch_on = false;
  g_launch.faulted = faulted;
  g_launch.blocks_run = blocks_run;
  g_launch.read_sectors = count_bits(g_rd);
  g_launch.write_sectors = count_bits(g_wr);
  g_launch.union_sectors = count_union(g_rd, g_wr);
  if (g_wrong == kDramNoDedupe) {
    g_launch.read_sectors = g_dram_nodedupe_rd;
    g_launch.write_sectors = g_dram_nodedupe_wr;
    g_launch.union_sectors = g_dram_nodedupe_rd + g_dram_nodedupe_wr;
  }
  g_dram_nodedupe_rd = g_dram_nodedupe_wr = 0;
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_cur) g_cur->launches.push_back(g_launch);
  g_cur = nullptr;
  g_epoch.clear();
  g_rd.clear();
  g_wr.clear();
}

void count_mma(int kind) {
  if (g_launch_on && kind >= 0 && kind < 4) ++g_launch.mma[kind];
}

}  // namespace prof

void profile_begin(int mode, int sample_one_in) {
  std::lock_guard<std::mutex> lock(prof::g_mutex);
  prof::check_env();
  prof::reset();
  prof::g_mode = mode == 1 ? 1 : 0;
  prof::g_sample = sample_one_in > 1 ? sample_one_in : 1;
  prof::g_wrong = prof::wrong_rule_from_env();
  prof::g_on = true;
}

bool profile_active() { return prof::g_on; }

bool profile_end(const char* path) {
  std::lock_guard<std::mutex> lock(prof::g_mutex);
  bool ok = true;
  if (path && path[0]) ok = prof::write_json(path);
  prof::g_on = false;
  prof::g_sample = 1;
  prof::g_whole_names.clear();
  prof::reset();
  return ok;
}

namespace detail {
void prof_record(uintptr_t site, int op, const void* addr, unsigned size, const void* addr2, unsigned size2) {
  prof::on_access(site, op, addr, size, addr2, size2);
}
}  // namespace detail

}  // namespace fastinfer::simt

// C entry points (for ctypes: fastinfer.simt.profile on the instrumented torch module).
extern "C" __attribute__((visibility("default"))) int fastinfer_simt_profile_begin(int mode, int sample_one_in) {
  fastinfer::simt::profile_begin(mode, sample_one_in);
  return 0;
}
// Newline-separated kernel-name fragments whose launches run whole under sampling (until profile_end).
extern "C" __attribute__((visibility("default"))) int fastinfer_simt_profile_run_whole(const char* fragments) {
  std::lock_guard<std::mutex> lock(fastinfer::simt::prof::g_mutex);
  auto& names = fastinfer::simt::prof::g_whole_names;
  names.clear();
  for (const char* p = fragments ? fragments : ""; *p;) {
    const char* end = strchr(p, '\n');
    const size_t n = end ? static_cast<size_t>(end - p) : strlen(p);
    if (n > 0) names.emplace_back(p, n);
    p += n + (end ? 1 : 0);
  }
  return 0;
}
extern "C" __attribute__((visibility("default"))) int fastinfer_simt_profile_end(const char* path) {
  return fastinfer::simt::profile_end(path) ? 0 : 1;
}
