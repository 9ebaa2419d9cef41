// cuBLASLt calls (compiled only with the CUDA backend): one handle per device,
// the device's stream, a 32 MiB workspace per device from the caching allocator,
// and a plan per GEMM shape and thread (descriptors and the heuristic's first algorithm)
// kept for the process's life. Row-major C = op(A) op(B) is column-major
// C^T = op(B)^T op(A)^T: cuBLASLt's A is our B, its B our A (as in cublas.cpp).
// docs/cuda.md, "cuBLASLt epilogues".
#include "backend/cuda/cublaslt.h"

#include <array>
#include <atomic>
#include <cmath>
#include <map>
#include <mutex>
#include <tuple>
#include <vector>

#include <cublasLt.h>
#include <spdlog/spdlog.h>

#include "backend/cuda/check.h"
#include "backend/cuda/cublas.h"
#include "backend/cuda/runtime.h"
#include "core/launch_count.h"

#define MT_CUBLASLT_CHECK(call)                                                                     \
  do {                                                                                              \
    cublasStatus_t st_ = (call);                                                                    \
    if (st_ != CUBLAS_STATUS_SUCCESS) [[unlikely]]                                                  \
      throw ::moetrain::Error(::fmt::format("cuBLASLt call {} failed: {} ({})", #call,               \
                                            cublasLtGetStatusString(st_), static_cast<int>(st_)));  \
  } while (0)

namespace moetrain::cuda {

namespace {

constexpr int64_t kWorkspaceBytes = int64_t{32} << 20;

struct LtDevice {
  std::once_flag once;
  cublasLtHandle_t handle = nullptr;
  void* workspace = nullptr;
  std::once_flag gelu_once;
  GeluForm gelu = GeluForm::unknown;
};
std::array<LtDevice, kMaxDevices> g_lt_device;

LtDevice& lt_device(int device) {
  MT_CHECK(device >= 0 && device < kMaxDevices, "cuda:{}: no such device", device);
  set_device(device);
  LtDevice& s = g_lt_device[static_cast<size_t>(device)];
  std::call_once(s.once, [&s, device] {
    MT_CUBLASLT_CHECK(cublasLtCreate(&s.handle));
    s.workspace = device_malloc(kWorkspaceBytes, device);  // kept for the process's life
  });
  return s;
}

// A plan: the descriptors of one GEMM shape and the algorithm the heuristic chose
// (none: ok = false, the caller falls back). Keyed by everything the descriptors
// and the heuristic see; pointers are all 16-byte aligned (lt_refusal), so their
// alignment is the same for every call of a key.
using PlanKey = std::tuple<int, int, bool, bool, bool, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int,
                           int64_t>;
struct Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t layout_a = nullptr, layout_b = nullptr, layout_c = nullptr;
  cublasLtMatmulAlgo_t algo{};
  bool ok = false;
};
// Per thread: a cached descriptor's pointers (bias, aux) are set per call, so each
// thread has its own plans and a GEMM takes no lock (a shape's plan is made once per
// thread; in training, one thread per device).
thread_local std::map<PlanKey, Plan> t_plans;

// LtStats, counted without a lock.
std::array<std::atomic<int64_t>, 4> g_runs{}, g_unavailable{}, g_disabled{};
std::atomic<int64_t> g_fallbacks{0};

cublasLtEpilogue_t to_lt(LtEpilogue e) {
  switch (e) {
    case LtEpilogue::bias: return CUBLASLT_EPILOGUE_BIAS;
    case LtEpilogue::gelu_aux_bias: return CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
    case LtEpilogue::dgelu_bgrad: return CUBLASLT_EPILOGUE_DGELU_BGRAD;
    case LtEpilogue::bgrad_a: return CUBLASLT_EPILOGUE_BGRADB;  // its B is our A
  }
  MT_THROW("cuBLASLt: unknown epilogue");
}

template <class T>
void set_attr(cublasLtMatmulDesc_t d, cublasLtMatmulDescAttributes_t attr, const T& v) {
  MT_CUBLASLT_CHECK(cublasLtMatmulDescSetAttribute(d, attr, &v, sizeof(v)));
}

bool with_aux(LtEpilogue e) { return e == LtEpilogue::gelu_aux_bias || e == LtEpilogue::dgelu_bgrad; }

Plan make_plan(const LtGemm& g, LtDevice& s) {
  const bool tf32 = g.dtype == DType::f32 && allow_tf32();
  const cudaDataType_t type = g.dtype == DType::bf16 ? CUDA_R_16BF : CUDA_R_32F;
  Plan p;
  MT_CUBLASLT_CHECK(
      cublasLtMatmulDescCreate(&p.desc, tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F, CUDA_R_32F));
  // Column-major: D (n x m) = op(B)^T (n x k) op(A)^T (k x m).
  const cublasOperation_t op_first = g.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, op_second = g.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  set_attr(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, op_first);
  set_attr(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, op_second);
  set_attr(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, to_lt(g.epilogue));
  set_attr(p.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, g.bias);
  if (with_aux(g.epilogue)) {
    set_attr(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, g.aux);
    set_attr(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, g.ld_aux);
  }
  // Stored shapes, column-major: our row-major B [k, n] ([n, k] transposed) is n x k (k x n).
  MT_CUBLASLT_CHECK(cublasLtMatrixLayoutCreate(&p.layout_a, type, static_cast<uint64_t>(g.trans_b ? g.k : g.n),
                                               static_cast<uint64_t>(g.trans_b ? g.n : g.k), g.ldb));
  MT_CUBLASLT_CHECK(cublasLtMatrixLayoutCreate(&p.layout_b, type, static_cast<uint64_t>(g.trans_a ? g.m : g.k),
                                               static_cast<uint64_t>(g.trans_a ? g.k : g.m), g.lda));
  MT_CUBLASLT_CHECK(
      cublasLtMatrixLayoutCreate(&p.layout_c, type, static_cast<uint64_t>(g.n), static_cast<uint64_t>(g.m), g.ldc));
  cublasLtMatmulPreference_t pref = nullptr;
  MT_CUBLASLT_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  const uint64_t ws = static_cast<uint64_t>(kWorkspaceBytes);
  MT_CUBLASLT_CHECK(
      cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(s.handle, p.desc, p.layout_a, p.layout_b, p.layout_c,
                                                           p.layout_c, pref, 1, &result, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  if (st == CUBLAS_STATUS_SUCCESS && found > 0) {
    p.algo = result.algo;
    p.ok = true;
  } else {  // no algorithm (NOT_SUPPORTED) or a combination this cuBLASLt refuses: the plain path, said once per shape
    spdlog::warn("cuBLASLt: no algorithm for the {} epilogue, {} M {} N {} K {} ({}); plain cuBLAS for this shape",
                 lt_epilogue_name(g.epilogue), dtype_name(g.dtype), g.m, g.n, g.k,
                 st == CUBLAS_STATUS_SUCCESS ? "none found" : cublasLtGetStatusString(st));
  }
  return p;
}

// The matmul itself, for a GEMM lt_refusal takes (lt_matmul asks it first; the probe's
// is aligned by construction), without the GELU check (the probe runs through here).
// False when cuBLASLt offers no algorithm for the shape.
bool run(const LtGemm& g, int device) {
  LtDevice& s = lt_device(device);
  const bool tf32 = g.dtype == DType::f32 && allow_tf32();
  const PlanKey key{device, static_cast<int>(g.dtype), tf32, g.trans_a, g.trans_b, g.m, g.n, g.k,
                    g.lda, g.ldb, g.ldc, static_cast<int>(g.epilogue), with_aux(g.epilogue) ? g.ld_aux : 0};
  auto it = t_plans.find(key);
  if (it == t_plans.end()) it = t_plans.emplace(key, make_plan(g, s)).first;
  Plan& p = it->second;
  if (!p.ok) return false;
  set_attr(p.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, g.bias);
  if (with_aux(g.epilogue)) set_attr(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, g.aux);
  const float one = 1.0f, zero = 0.0f;
  count_cuda_library_call();
  MT_CUBLASLT_CHECK(cublasLtMatmul(s.handle, p.desc, &one, g.b, p.layout_a, g.a, p.layout_b, &zero, g.c, p.layout_c,
                                   g.c, p.layout_c, &p.algo, s.workspace, static_cast<size_t>(kWorkspaceBytes),
                                   stream(device)));
  return true;
}

// GELU_AUX_BIAS on 256 points: A [256, 8] holds x in its first column, B is the
// 8 x 8 identity, bias 0; the aux output (the GELU's input as cuBLASLt saw it,
// after any TF32 rounding) and C's first column are read back and classified.
GeluForm probe_gelu(int device) {
  constexpr int64_t kPoints = 256, kCols = 8;
  std::vector<float> a(kPoints * kCols, 0.0f), b(kCols * kCols, 0.0f), bias(kCols, 0.0f);
  for (int64_t i = 0; i < kPoints; ++i) a[static_cast<size_t>(i * kCols)] = -4.0f + 8.0f * static_cast<float>(i) / (kPoints - 1);
  for (int64_t j = 0; j < kCols; ++j) b[static_cast<size_t>(j * kCols + j)] = 1.0f;
  const int64_t bytes_a = kPoints * kCols * 4, bytes_b = kCols * kCols * 4, bytes_bias = kCols * 4;
  void* da = device_malloc(bytes_a, device);
  void* db = device_malloc(bytes_b, device);
  void* dbias = device_malloc(bytes_bias, device);
  void* dc = device_malloc(bytes_a, device);
  void* daux = device_malloc(bytes_a, device);
  copy_host_to_device(da, a.data(), bytes_a, device);
  copy_host_to_device(db, b.data(), bytes_b, device);
  copy_host_to_device(dbias, bias.data(), bytes_bias, device);
  LtGemm g;
  g.dtype = DType::f32;
  g.m = kPoints;
  g.n = kCols;
  g.k = kCols;
  g.a = da;
  g.lda = kCols;
  g.b = db;
  g.ldb = kCols;
  g.c = dc;
  g.ldc = kCols;
  g.epilogue = LtEpilogue::gelu_aux_bias;
  g.bias = dbias;
  g.aux = daux;
  g.ld_aux = kCols;
  GeluForm form = GeluForm::unknown;
  MT_ASSERT(lt_refusal(g).empty(), "the GELU probe's GEMM must be one cuBLASLt takes");
  if (run(g, device)) {
    std::vector<float> c(static_cast<size_t>(kPoints * kCols)), aux(c.size());
    copy_device_to_host(c.data(), dc, bytes_a, device);
    copy_device_to_host(aux.data(), daux, bytes_a, device);
    std::vector<double> x(kPoints), y(kPoints);
    for (int64_t i = 0; i < kPoints; ++i) {
      x[static_cast<size_t>(i)] = aux[static_cast<size_t>(i * kCols)];
      y[static_cast<size_t>(i)] = c[static_cast<size_t>(i * kCols)];
    }
    form = classify_gelu(x.data(), y.data(), kPoints);
  }
  for (void* p : {da, db, dbias, dc, daux}) device_free(p, device);
  return form;
}

enum class LtOutcome { ran, unavailable, disabled, refused };

void count(const LtGemm& g, LtOutcome outcome) {
  const size_t e = static_cast<size_t>(g.epilogue);
  if (outcome == LtOutcome::ran) {
    g_runs[e].fetch_add(1, std::memory_order_relaxed);
    return;
  }
  if (outcome == LtOutcome::unavailable) g_unavailable[e].fetch_add(1, std::memory_order_relaxed);
  if (outcome == LtOutcome::disabled) g_disabled[e].fetch_add(1, std::memory_order_relaxed);
  g_fallbacks.fetch_add(1, std::memory_order_relaxed);
}

}  // namespace

GeluForm lt_gelu_form(int device) {
  LtDevice& s = lt_device(device);
  std::call_once(s.gelu_once, [&s, device] {
    s.gelu = probe_gelu(device);
    if (s.gelu == GeluForm::tanh)
      spdlog::debug("cuda:{}: cuBLASLt's GELU epilogue is the tanh form; fused linear + GELU on", device);
    else
      spdlog::warn("cuda:{}: cuBLASLt's GELU epilogue is not the tanh GELU this model uses (probe: {}); linear + GELU "
                   "runs unfused (docs/cuda.md, cuBLASLt epilogues)", device, gelu_form_name(s.gelu));
  });
  return s.gelu;
}

bool lt_matmul(const LtGemm& g, int device) {
  LtOutcome outcome = LtOutcome::ran;
  if ((lt_epilogues_enabled() & (1u << static_cast<int>(g.epilogue))) == 0) outcome = LtOutcome::disabled;
  else if (!lt_refusal(g).empty()) outcome = LtOutcome::refused;
  else if (with_aux(g.epilogue) && lt_gelu_form(device) != GeluForm::tanh) outcome = LtOutcome::unavailable;
  else if (!run(g, device)) outcome = LtOutcome::unavailable;  // no algorithm for this shape (warned once)
  count(g, outcome);
  return outcome == LtOutcome::ran;
}

LtStats lt_stats() {
  LtStats s;
  for (size_t i = 0; i < g_runs.size(); ++i) {
    s.runs[i] = g_runs[i].load(std::memory_order_relaxed);
    s.unavailable[i] = g_unavailable[i].load(std::memory_order_relaxed);
    s.disabled[i] = g_disabled[i].load(std::memory_order_relaxed);
  }
  s.fallbacks = g_fallbacks.load(std::memory_order_relaxed);
  return s;
}

}  // namespace moetrain::cuda
