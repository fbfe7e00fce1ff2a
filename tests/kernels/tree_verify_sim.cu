// tree_verify (launch_tree_verify) on inputs the torch binding would reject, straight through the
// launcher: malformed trees (root with a parent, parents >= child, cycles), token ids outside
// [0, V), rows of -inf logits (no mass), draft probabilities that are zero or do not match the
// tokens. The kernel must terminate, report success and return well-formed outputs (a path of
// parent links from node 0, -1 padding, num_accepted = path length - 1, next_token in [0, V)),
// bit-identical across schedule seeds. Builds with nvcc too:
//   nvcc -std=c++20 -arch=sm_90a -Icuda/include tests/kernels/tree_verify_sim.cu -o tv && ./tv
#include "../../cuda/src/tree_verify.cu"
#include "kernel_test_util.h"

#include <cmath>

using fastinfer::DType;
using fastinfer::IndexType;
using fastinfer::TreeVerifyParams;

static Checksum g_sum;

bool run_case(const char* name, int B, int N, int V, bool draft, bool greedy, uint64_t seed, int corrupt) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> unif(0.f, 1.f);
  std::normal_distribution<float> normal(0.f, 2.f);
  std::vector<int64_t> tokens(B * N), parents(B * N);
  for (int b = 0; b < B; ++b)
    for (int i = 0; i < N; ++i) {
      parents[b * N + i] = i == 0 ? -1 : static_cast<int64_t>(rng() % i);
      tokens[b * N + i] = static_cast<int64_t>(rng() % V);
    }
  std::vector<float> logits(static_cast<size_t>(B) * N * V), probs(draft ? logits.size() : 0);
  for (auto& x : logits) x = normal(rng);
  for (auto& x : probs) x = unif(rng) / V;
  if (corrupt & 1)  // parents: root with a parent, self loops, forward edges, cycles
    for (int b = 0; b < B; ++b) {
      parents[b * N] = static_cast<int64_t>(rng() % N);
      for (int i = 1; i < N; ++i)
        if (rng() % 3 == 0) parents[b * N + i] = static_cast<int64_t>(rng() % (2 * N)) - N / 2;
    }
  if (corrupt & 2)  // token ids outside [0, V)
    for (auto& t : tokens)
      if (rng() % 2) t = rng() % 2 ? -1 - static_cast<int64_t>(rng() % 5) : V + static_cast<int64_t>(rng() % 5);
  if (corrupt & 4)  // no mass: -inf logits at some nodes, zero draft rows
    for (int r = 0; r < B * N; ++r)
      if (rng() % 2) {
        for (int v = 0; v < V; ++v) logits[static_cast<size_t>(r) * V + v] = -INFINITY;
        if (draft)
          for (int v = 0; v < V; ++v) probs[static_cast<size_t>(r) * V + v] = 0.f;
      }
  std::vector<float> temp(B), uni(B * (N + 1));
  for (auto& t : temp) t = 0.5f + unif(rng);
  for (auto& u : uni) u = unif(rng);

  DeviceBuffer<int64_t> d_tok(tokens), d_par(parents), d_acc(B * N), d_num(B), d_next(B);
  DeviceBuffer<float> d_logits(logits), d_temp(temp), d_uni(uni);
  DeviceBuffer<float> d_probs(draft ? probs : std::vector<float>(1));
  TreeVerifyParams p;
  p.draft_tokens = d_tok.ptr;
  p.parents = d_par.ptr;
  p.target_logits = d_logits.ptr;
  p.draft_probs = draft ? d_probs.ptr : nullptr;
  p.temperature = d_temp.ptr;
  p.uniforms = d_uni.ptr;
  p.accepted_nodes = d_acc.ptr;
  p.num_accepted = d_num.ptr;
  p.next_token = d_next.ptr;
  p.batch_size = B;
  p.num_nodes = N;
  p.vocab_size = V;
  p.greedy = greedy;
  p.logits_dtype = DType::kFloat32;
  p.index_type = IndexType::kInt64;
  const size_t ws = fastinfer::tree_verify_workspace_size(p);
  EXPECT(ws == (draft && !greedy ? static_cast<size_t>(2) * B * V * sizeof(float) : 0), "%s: workspace %zu", name, ws);
  DeviceBuffer<float> d_ws(ws / sizeof(float) + 4);
  p.workspace = d_ws.ptr;
  CHECK_CUDA(fastinfer::launch_tree_verify(p, nullptr));
  CHECK_CUDA(cudaDeviceSynchronize());
  const auto acc = d_acc.download();
  const auto num = d_num.download();
  const auto next = d_next.download();
  bool ok = true;
  for (int b = 0; b < B; ++b) {
    const int64_t n = num[b];
    bool good = n >= 0 && n < N && acc[b * N] == 0 && next[b] >= 0 && next[b] < V;
    for (int64_t i = 1; good && i <= n; ++i) {
      const int64_t node = acc[b * N + i], prev = acc[b * N + i - 1];
      good = node > prev && node < N && parents[b * N + node] == prev && tokens[b * N + node] >= 0 &&
             tokens[b * N + node] < V;
    }
    for (int64_t i = n + 1; good && i < N; ++i) good = acc[b * N + i] == -1;
    EXPECT(good, "%s: sequence %d: malformed outputs (num_accepted %lld, next_token %lld)", name, b,
              static_cast<long long>(n), static_cast<long long>(next[b]));
    ok &= good;
  }
  g_sum.add(acc.data(), acc.size() * 8);
  g_sum.add(num.data(), num.size() * 8);
  g_sum.add(next.data(), next.size() * 8);
  std::printf("tree_verify %-28s B=%d N=%d V=%d draft=%d greedy=%d: %s\n", name, B, N, V, draft, greedy,
              ok ? "ok" : "MALFORMED");
  return ok;
}

int main() {
  bool ok = true;
  const char* names[] = {"valid", "bad-parents", "bad-tokens", "bad-parents+tokens", "no-mass", "", "", "all"};
  for (int corrupt : {0, 1, 2, 3, 4, 7})
    for (int mode = 0; mode < 3; ++mode) {
      const bool draft = mode == 1, greedy = mode == 2;
      ok &= run_case(names[corrupt], 6, 12, 37, draft, greedy, 100 + corrupt * 3 + mode, corrupt);     // scalar path
      ok &= run_case(names[corrupt], 3, 9, 4096, draft, greedy, 200 + corrupt * 3 + mode, corrupt);    // 32 warps
    }
  std::printf("checksum %016llx\n", static_cast<unsigned long long>(g_sum.h));
  return ok && g_failures == 0 ? 0 : 1;
}
