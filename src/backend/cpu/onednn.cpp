#include "backend/cpu/onednn.h"

#include <cstring>
#include <iterator>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>
#include <vector>

#include <oneapi/dnnl/dnnl.hpp>

#include "backend/cpu/blas.h"
#include "core/error.h"

namespace moetrain::cpu::onednn {

namespace {

using onednn_dt = dnnl::memory::data_type;
using onednn_dims = dnnl::memory::dims;

dnnl::engine& onednn_engine() {
  static dnnl::engine engine = [] {
    // oneDNN's own primitive cache (1,024 by default) would keep every primitive
    // ours drops (below): ours is the only one.
    dnnl::set_primitive_cache_capacity(0);
    return dnnl::engine(dnnl::engine::kind::cpu, 0);
  }();
  return engine;
}

onednn_dt onednn_type(DType t, const char* what) {
  switch (t) {
    case DType::f32: return onednn_dt::f32;
    case DType::bf16: return onednn_dt::bf16;
    default: MT_THROW("onednn::matmul: {} is {}; expected f32 or bf16", what, t);
  }
}

// Logical [batch?, rows, cols] of a matrix stored row-major with leading dimension ld
// (transposed: stored as [cols, rows]); a batch stride of 0 broadcasts (dims 1).
dnnl::memory::desc onednn_matrix(onednn_dt type, int64_t batch, int64_t stride, int64_t rows, int64_t cols, int64_t ld,
                                 bool trans) {
  const onednn_dims d2 = {rows, cols};
  const onednn_dims s2 = trans ? onednn_dims{1, ld} : onednn_dims{ld, 1};
  if (batch == 1) return dnnl::memory::desc(d2, type, s2);
  const int64_t b = stride == 0 ? 1 : batch;
  const int64_t bs = stride == 0 ? rows * cols : stride;
  return dnnl::memory::desc({b, rows, cols}, type, {bs, s2[0], s2[1]});
}

using OnednnKey = std::tuple<bool, bool, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                             int64_t, int64_t, int, int, bool>;

struct OnednnEntry {
  dnnl::matmul prim;
  dnnl::memory::desc a, b, c, scratch;
  std::string impl;  // oneDNN's implementation, "brg:avx512_core_amx", "gemm:jit", ...
  int64_t* calls = nullptr;  // impl's count in onednn_impl_calls (a map node: stable); under onednn_mutex
};

// The primitives by shape, at most kCachedPrimitives (an MoE layer's expert products
// change their row counts every step: an unbounded cache grew by every new count,
// k3-tiny bf16's peak memory 2.2x the ledger's after 6 steps). A segmented LRU: a new
// shape enters the probation list; one used again moves to the protected list, which
// the one-off shapes of a step cannot flush (the dense layers' shapes stay made);
// each list drops its least recently used past its share. A user of a dropped entry
// keeps it alive (shared_ptr).
constexpr size_t kOnednnProtected = kCachedPrimitives / 4, kOnednnProbation = kCachedPrimitives - kOnednnProtected;
struct OnednnSlot {
  std::shared_ptr<const OnednnEntry> entry;
  bool is_protected = false;
  std::list<OnednnKey>::iterator at;
};
std::mutex onednn_mutex;
// impl_counts(), under onednn_mutex; reset_impl_counts() zeroes the counts and keeps the
// nodes, which the entries point to.
std::map<std::string, int64_t> onednn_impl_calls;
std::list<OnednnKey> onednn_probation, onednn_protected;  // most recent first
std::map<OnednnKey, OnednnSlot> onednn_cache;

// A hit: to the front of the protected list, its oldest back to probation past its share.
void onednn_touch(OnednnSlot& slot) {
  std::list<OnednnKey>& from = slot.is_protected ? onednn_protected : onednn_probation;
  onednn_protected.splice(onednn_protected.begin(), from, slot.at);
  slot.is_protected = true;
  if (onednn_protected.size() > kOnednnProtected) {
    OnednnSlot& old = onednn_cache.at(onednn_protected.back());
    onednn_probation.splice(onednn_probation.begin(), onednn_protected, std::prev(onednn_protected.end()));
    old.is_protected = false;
    old.at = onednn_probation.begin();
  }
}

// A, B and C of s (batch strides ignored for one product); with `runtime`, the
// primitive's view: m and k as runtime dimensions where s says so.
struct OnednnDescs {
  dnnl::memory::desc a, b, c;
};
OnednnDescs onednn_descs(const MatmulShape& s, onednn_dt ab, onednn_dt ct, bool runtime) {
  const int64_t sa = s.batch == 1 ? 0 : s.stride_a, sb = s.batch == 1 ? 0 : s.stride_b;
  const int64_t sc = s.batch == 1 ? 0 : s.stride_c;
  const int64_t m = runtime && s.runtime_m ? DNNL_RUNTIME_DIM_VAL : s.m;
  const int64_t k = runtime && s.runtime_k ? DNNL_RUNTIME_DIM_VAL : s.k;
  return {onednn_matrix(ab, s.batch, sa, m, k, s.lda, s.trans_a), onednn_matrix(ab, s.batch, sb, k, s.n, s.ldb, s.trans_b),
          onednn_matrix(ct, s.batch, sc, m, s.n, s.ldc, false)};
}

OnednnKey onednn_key(const MatmulShape& s, onednn_dt ab, onednn_dt ct, bool accumulate) {
  const int64_t sa = s.batch == 1 ? 0 : s.stride_a, sb = s.batch == 1 ? 0 : s.stride_b;
  const int64_t sc = s.batch == 1 ? 0 : s.stride_c;
  return OnednnKey{s.trans_a,
                      s.trans_b,
                      s.batch,
                      s.runtime_m ? -1 : s.m,
                      s.n,
                      s.runtime_k ? -1 : s.k,
                      s.lda,
                      s.ldb,
                      s.ldc,
                      sa,
                      sb,
                      sc,
                      static_cast<int>(ab),
                      static_cast<int>(ct),
                      accumulate};
}

std::shared_ptr<const OnednnEntry> onednn_primitive(const MatmulShape& s, onednn_dt ab, onednn_dt ct, bool accumulate) {
  const OnednnKey key = onednn_key(s, ab, ct, accumulate);
  std::lock_guard<std::mutex> lock(onednn_mutex);
  if (auto it = onednn_cache.find(key); it != onednn_cache.end()) {
    onednn_touch(it->second);
    ++*it->second.entry->calls;
    return it->second.entry;
  }
  auto e = std::make_shared<OnednnEntry>();
  const OnednnDescs d = onednn_descs(s, ab, ct, /*runtime=*/true);
  e->a = d.a, e->b = d.b, e->c = d.c;
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  if (accumulate) {
    dnnl::post_ops ops;
    ops.append_sum(1.0f);
    attr.set_post_ops(ops);
  }
  try {
    dnnl::matmul::desc desc(e->a, e->b, e->c);
    dnnl::matmul::primitive_desc pd(desc, attr, onednn_engine());
    e->scratch = pd.scratchpad_desc();
    e->impl = pd.impl_info_str();
    e->prim = dnnl::matmul(pd);
  } catch (const dnnl::error& err) {
    MT_THROW("onednn::matmul: oneDNN refused [{}x{}]{} x [{}x{}]{} (batch {}): {}", s.m, s.k, s.trans_a ? "^T" : "",
             s.k, s.n, s.trans_b ? "^T" : "", s.batch, err.what());
  }
  e->calls = &onednn_impl_calls[e->impl];
  ++*e->calls;
  onednn_probation.push_front(key);
  onednn_cache.emplace(key, OnednnSlot{e, false, onednn_probation.begin()});
  if (onednn_probation.size() > kOnednnProbation) {
    onednn_cache.erase(onednn_probation.back());
    onednn_probation.pop_back();
  }
  return e;
}

// Whether oneDNN has a bf16 matmul on this CPU: it has none below AVX-512 (an
// AVX2-only CPU, or ONEDNN_MAX_CPU_ISA=AVX2), where creating one throws. Asked once.
bool onednn_has_bf16() {
  static const bool has = [] {
    try {
      const dnnl::memory::desc a({4, 16}, onednn_dt::bf16, onednn_dims{16, 1});
      const dnnl::memory::desc b({16, 16}, onednn_dt::bf16, onednn_dims{16, 1});
      const dnnl::memory::desc c({4, 16}, onednn_dt::f32, onednn_dims{16, 1});
      dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(a, b, c), onednn_engine());
      return true;
    } catch (const dnnl::error&) {
      return false;
    }
  }();
  return has;
}

// A stored matrix (rows x cols at ld) of bf16 widened into a packed f32 buffer (exact).
void widen_stored(const bf16* p, int64_t rows, int64_t cols, int64_t ld, std::vector<float>& out) {
  out.resize(static_cast<size_t>(rows * cols));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < cols; ++j) out[static_cast<size_t>(r * cols + j)] = p[r * ld + j].to_float();
}

// The bf16 products where oneDNN has no bf16 kernel: A and B widened to f32 (exact), the
// f32 GEMM route (blas.h) accumulating in f32, C rounded to bf16 once. The same math as
// oneDNN's bf16 kernels (exact products, f32 sums), in the f32 route's order.
void widened_bf16_matmul(const MatmulShape& s, const void* a, const void* b, DType c_type, void* c, bool accumulate) {
  std::vector<float> fa, fb, fc;
  const int64_t ra = s.trans_a ? s.k : s.m, ca = s.trans_a ? s.m : s.k;
  const int64_t rb = s.trans_b ? s.n : s.k, cb = s.trans_b ? s.k : s.n;
  for (int64_t i = 0; i < s.batch; ++i) {
    widen_stored(static_cast<const bf16*>(a) + i * s.stride_a, ra, ca, s.lda, fa);
    widen_stored(static_cast<const bf16*>(b) + i * s.stride_b, rb, cb, s.ldb, fb);
    if (c_type == DType::f32) {
      float* ci = static_cast<float*>(c) + i * s.stride_c;
      gemm(s.trans_a, s.trans_b, s.m, s.n, s.k, 1.0f, fa.data(), ca, fb.data(), cb, accumulate ? 1.0f : 0.0f, ci,
           s.ldc);
      continue;
    }
    bf16* ci = static_cast<bf16*>(c) + i * s.stride_c;
    if (accumulate) widen_stored(ci, s.m, s.n, s.ldc, fc);
    else fc.assign(static_cast<size_t>(s.m * s.n), 0.0f);
    gemm(s.trans_a, s.trans_b, s.m, s.n, s.k, 1.0f, fa.data(), ca, fb.data(), cb, accumulate ? 1.0f : 0.0f,
         fc.data(), s.n);
    for (int64_t r = 0; r < s.m; ++r)
      for (int64_t j = 0; j < s.n; ++j) ci[r * s.ldc + j] = bf16::from_float(fc[static_cast<size_t>(r * s.n + j)]);
  }
}

}  // namespace

bool has_bf16_kernels() { return onednn_has_bf16(); }

void matmul(const MatmulShape& s, DType ab, const void* a, const void* b, DType c_type, void* c, bool accumulate) {
  const onednn_dt tab = onednn_type(ab, "a/b"), tc = onednn_type(c_type, "c");
  MT_CHECK(!(ab == DType::f32 && c_type == DType::bf16), "onednn::matmul: f32 inputs with a bf16 output");
  if (s.batch <= 0 || s.m <= 0 || s.n <= 0) return;
  if (s.k <= 0) {
    if (accumulate) return;
    const int64_t es = dtype_size(c_type);
    for (int64_t i = 0; i < s.batch; ++i)
      for (int64_t r = 0; r < s.m; ++r)
        std::memset(static_cast<char*>(c) + (i * s.stride_c + r * s.ldc) * es, 0, static_cast<size_t>(s.n * es));
    return;
  }
  if (ab == DType::bf16 && !onednn_has_bf16()) {
    widened_bf16_matmul(s, a, b, c_type, c, accumulate);
    return;
  }
  const auto e = onednn_primitive(s, tab, tc, accumulate);
  dnnl::engine& eng = onednn_engine();
  thread_local dnnl::stream stream(eng);
  thread_local std::vector<uint8_t> scratch_buf;
  const size_t scratch_bytes = e->scratch.get_size();
  if (scratch_buf.size() < scratch_bytes) scratch_buf.resize(scratch_bytes);
  // Runtime dims: the memory objects take this call's sizes.
  const OnednnDescs d =
      s.runtime_m || s.runtime_k ? onednn_descs(s, tab, tc, /*runtime=*/false) : OnednnDescs{e->a, e->b, e->c};
  dnnl::memory ma(d.a, eng, const_cast<void*>(a)), mb(d.b, eng, const_cast<void*>(b)), mc(d.c, eng, c);
  dnnl::memory ms(e->scratch, eng, scratch_bytes ? scratch_buf.data() : nullptr);
  e->prim.execute(stream, {{DNNL_ARG_SRC, ma}, {DNNL_ARG_WEIGHTS, mb}, {DNNL_ARG_DST, mc}, {DNNL_ARG_SCRATCHPAD, ms}});
  stream.wait();
}

std::string effective_isa() {
  switch (dnnl::get_effective_cpu_isa()) {
    case dnnl::cpu_isa::all: return "all";
    case dnnl::cpu_isa::sse41: return "sse41";
    case dnnl::cpu_isa::avx: return "avx";
    case dnnl::cpu_isa::avx2: return "avx2";
    case dnnl::cpu_isa::avx512_mic: return "avx512_mic";
    case dnnl::cpu_isa::avx512_mic_4ops: return "avx512_mic_4ops";
    case dnnl::cpu_isa::avx512_core: return "avx512_core";
    case dnnl::cpu_isa::avx512_core_vnni: return "avx512_core_vnni";
    case dnnl::cpu_isa::avx512_core_bf16: return "avx512_core_bf16";
    case dnnl::cpu_isa::avx512_core_amx: return "avx512_core_amx";
    case dnnl::cpu_isa::avx2_vnni: return "avx2_vnni";
  }
  return "unknown";
}

std::string matmul_impl(int64_t m, int64_t n, int64_t k, DType ab) {
  if (ab == DType::bf16 && !onednn_has_bf16()) return "none at this ISA: bf16 products widen to f32, the f32 GEMM route";
  const onednn_dt t = onednn_type(ab, "a/b");
  dnnl::matmul::desc desc(dnnl::memory::desc({m, k}, t, onednn_dims{k, 1}),
                          dnnl::memory::desc({k, n}, t, onednn_dims{n, 1}),
                          dnnl::memory::desc({m, n}, onednn_dt::f32, onednn_dims{n, 1}));
  dnnl::matmul::primitive_desc pd(desc, onednn_engine());
  return pd.impl_info_str();
}

std::string version() {
  const dnnl_version_t* v = dnnl_version();
  return fmt::format("oneDNN {}.{}.{}", v->major, v->minor, v->patch);
}

size_t cached_primitives() {
  std::lock_guard<std::mutex> lock(onednn_mutex);
  return onednn_cache.size();
}

std::map<std::string, int64_t> impl_counts() {
  std::lock_guard<std::mutex> lock(onednn_mutex);
  std::map<std::string, int64_t> out;
  for (const auto& [impl, n] : onednn_impl_calls)
    if (n > 0) out.emplace(impl, n);
  return out;
}

void reset_impl_counts() {
  std::lock_guard<std::mutex> lock(onednn_mutex);
  for (auto& [impl, n] : onednn_impl_calls) n = 0;
}

bool is_cached(const MatmulShape& s, DType ab, DType c_type, bool accumulate) {
  const OnednnKey key = onednn_key(s, onednn_type(ab, "a/b"), onednn_type(c_type, "c"), accumulate);
  std::lock_guard<std::mutex> lock(onednn_mutex);
  return onednn_cache.count(key) > 0;
}

}  // namespace moetrain::cpu::onednn
