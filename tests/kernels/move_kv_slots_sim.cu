// move_kv_slots (launch_move_kv_slots): chains such as 5 -> 4, 7 -> 5 (all sources read before any
// write), int32 and int64 slots, 16-byte and byte paths, negative slots skipped, num_moves == 0.
#include "../../cuda/src/cache_move.cu"
#include "kernel_test_util.h"

using fastinfer::IndexType;
using fastinfer::MoveKvSlotsParams;

template <typename I>
bool run_case(int64_t num_slots, int64_t row_bytes, std::vector<I> src, std::vector<I> dst, int misalign,
              uint64_t seed) {
  std::mt19937_64 rng(seed);
  const size_t bytes = static_cast<size_t>(num_slots * row_bytes);
  std::vector<unsigned char> k(bytes + misalign), v(bytes + misalign);
  for (auto& x : k) x = static_cast<unsigned char>(rng());
  for (auto& x : v) x = static_cast<unsigned char>(rng());
  std::vector<unsigned char> ref_k = k, ref_v = v;
  for (size_t i = 0; i < src.size(); ++i) {
    if (src[i] < 0 || dst[i] < 0) continue;
    std::memcpy(&ref_k[misalign + dst[i] * row_bytes], &k[misalign + src[i] * row_bytes], row_bytes);
    std::memcpy(&ref_v[misalign + dst[i] * row_bytes], &v[misalign + src[i] * row_bytes], row_bytes);
  }
  DeviceBuffer<unsigned char> d_k(k), d_v(v);
  DeviceBuffer<I> d_src(src), d_dst(dst);
  MoveKvSlotsParams p;
  p.k_cache = d_k.ptr + misalign;
  p.v_cache = d_v.ptr + misalign;
  p.src_slots = d_src.ptr;
  p.dst_slots = d_dst.ptr;
  p.slot_type = sizeof(I) == 4 ? IndexType::kInt32 : IndexType::kInt64;
  p.num_moves = static_cast<int64_t>(src.size());
  p.row_bytes = row_bytes;
  const size_t ws = fastinfer::move_kv_slots_workspace_size(p);
  EXPECT(ws % 16 == 0 && ws >= static_cast<size_t>(p.num_moves * row_bytes * 2), "workspace size %zu", ws);
  DeviceBuffer<unsigned char> d_ws(ws > 0 ? ws : 16);
  p.workspace = d_ws.ptr;
  CHECK_CUDA(fastinfer::launch_move_kv_slots(p, nullptr));
  CHECK_CUDA(cudaDeviceSynchronize());
  const bool ok = d_k.download() == ref_k && d_v.download() == ref_v;
  EXPECT(ok, "moves differ (index %d bytes, row_bytes %lld, misalign %d)", static_cast<int>(sizeof(I)),
            static_cast<long long>(row_bytes), misalign);
  std::printf("move_kv_slots I=int%d row_bytes=%lld moves=%zu misalign=%d: %s\n", static_cast<int>(8 * sizeof(I)),
              static_cast<long long>(row_bytes), src.size(), misalign, ok ? "ok" : "MISMATCH");
  return ok;
}

int main() {
  bool ok = true;
  ok &= run_case<int64_t>(16, 2 * 64 * 2, {5, 7}, {4, 5}, 0, 1);                  // chain 5->4, 7->5
  ok &= run_case<int32_t>(16, 2 * 64 * 2, {7, 5}, {5, 4}, 0, 2);                  // same, other order
  ok &= run_case<int32_t>(32, 4 * 128 * 2, {3, 4, 5, 6, 9}, {2, 3, 4, 5, 6}, 0, 3);  // long chain
  ok &= run_case<int64_t>(16, 8 * 64 * 2 + 6, {1, 2}, {2, 1}, 0, 4);              // swap, byte path (row % 16)
  ok &= run_case<int32_t>(16, 2 * 64, {5, -1, 7}, {4, 3, -1}, 4, 5);              // misaligned, skipped moves
  ok &= run_case<int64_t>(8, 64, {}, {}, 0, 6);                                   // num_moves == 0
  MoveKvSlotsParams bad;
  bad.num_moves = 1;
  bad.row_bytes = 16;
  EXPECT(fastinfer::launch_move_kv_slots(bad, nullptr) == cudaErrorInvalidValue, "null pointers");
  std::printf("move_kv_slots: %s\n", ok && g_failures == 0 ? "OK" : "FAILED");
  return ok && g_failures == 0 ? 0 : 1;
}
