// CUDA KDA and linear attention, running the bodies of ops/kda/kda_simt.h (the same
// code the host tests run against the CPU kernels). Recurrent form: one thread
// block per (batch element, value head), steps in order; the backward's
// per-value-head dq/dk are then summed over each group of value heads in a fixed
// order. Chunked form: a block per (task, chunk) prepares every chunk at once, a
// block per (task, tile of 8..64 columns of S: kda_scan_columns of ops/kda/kda_tc.h,
// from the shape and the multiprocessor count) scans the chunks (forward) or scans
// them back (backward), a block per (task, chunk) writes O (forward) or the chunk's
// gradients (backward).
#include <algorithm>
#include <atomic>
#include <type_traits>

#include "backend/cuda/kernel_utils.cuh"
#include "ops/common/cuda_helpers.cuh"
#include "ops/kda/kda_kernels.h"
#include "ops/kda/kda_simt.h"
#include "ops/kda/kda_tc.h"
#include "ops/linear_attention/linear_attention_kernels.h"

namespace moetrain::cuda {

namespace {

using simt::KdaSimtArgs;

using simt::DeviceBlock;

template <class T, class A>
__global__ void kda_forward_kernel(KdaSimtArgs<T, A> a) {
  extern __shared__ __align__(16) unsigned char kda_shared[];
  simt::kda_simt_forward(DeviceBlock{static_cast<int>(blockDim.x)}, a, blockIdx.x, reinterpret_cast<A*>(kda_shared));
}

template <class T, class A>
__global__ void kda_backward_kernel(KdaSimtArgs<T, A> a) {
  extern __shared__ __align__(16) unsigned char kda_shared[];
  simt::kda_simt_backward(DeviceBlock{static_cast<int>(blockDim.x)}, a, blockIdx.x, reinterpret_cast<A*>(kda_shared));
}

template <class T, class A>
__global__ void kda_chunk_prepare_kernel(simt::KdaChunkArgs<T, A> a) {
  extern __shared__ __align__(16) unsigned char kda_shared[];
  const int64_t chunks = a.chunks(), block = blockIdx.x;
  simt::kda_chunk_prepare(DeviceBlock{static_cast<int>(blockDim.x)}, a, block / chunks, block % chunks,
                          reinterpret_cast<A*>(kda_shared));
}

template <class T, class A>
__global__ void kda_chunk_scan_kernel(simt::KdaChunkArgs<T, A> a) {
  simt::kda_chunk_scan(DeviceBlock{static_cast<int>(blockDim.x)}, a, blockIdx.x,
                       static_cast<int64_t>(blockIdx.y) * blockDim.x);
}

template <class T, class A>
__global__ void kda_chunk_output_kernel(simt::KdaChunkArgs<T, A> a) {
  const int64_t chunks = a.chunks(), block = blockIdx.x;
  simt::kda_chunk_output(DeviceBlock{static_cast<int>(blockDim.x)}, a, block / chunks, block % chunks);
}

template <class T, class A>
__global__ void group_sum_kernel(T* grad, const A* per_value_head, int64_t n, int64_t G, int64_t K) {
  MT_GRID_LOOP(e, n) simt::group_sum_element(grad, per_value_head, e, G, K);
}

template <class T, class A>
__global__ void kda_chunk_backward_scan_kernel(simt::KdaChunkArgs<T, A> a) {
  simt::kda_chunk_backward_scan(DeviceBlock{static_cast<int>(blockDim.x)}, a, blockIdx.x,
                                static_cast<int64_t>(blockIdx.y) * blockDim.x);
}

template <class T, class A>
__global__ void kda_chunk_grad_kernel(simt::KdaChunkArgs<T, A> a) {
  const int64_t chunks = a.chunks(), block = blockIdx.x;
  simt::kda_chunk_grad(DeviceBlock{static_cast<int>(blockDim.x)}, a, block / chunks, block % chunks);
}

// The tensor-core bodies (ops/kda/kda_tc.h): f32 arithmetic only (f32 and bf16 inputs).
template <class T>
__global__ void __launch_bounds__(simt::kKdaTcThreads) kda_chunk_scan_tc_kernel(simt::KdaChunkArgs<T, float> a,
                                                                                int64_t BV) {
  extern __shared__ __align__(128) unsigned char kda_tc_shared[];
  simt::kda_chunk_scan_tc<simt::DeviceTf32>(DeviceBlock{simt::kKdaTcThreads}, a, blockIdx.x,
                                            static_cast<int64_t>(blockIdx.y) * BV, BV,
                                            reinterpret_cast<float*>(kda_tc_shared));
}

template <class T>
__global__ void __launch_bounds__(simt::kKdaTcThreads) kda_chunk_output_tc_kernel(simt::KdaChunkArgs<T, float> a) {
  extern __shared__ __align__(128) unsigned char kda_tc_shared[];
  const int64_t chunks = a.chunks(), block = blockIdx.x;
  simt::kda_chunk_output_tc<simt::DeviceTf32>(DeviceBlock{simt::kKdaTcThreads}, a, block / chunks, block % chunks,
                                              reinterpret_cast<float*>(kda_tc_shared));
}

template <class T>
__global__ void __launch_bounds__(simt::kKdaTcThreads)
    kda_chunk_backward_scan_tc_kernel(simt::KdaChunkArgs<T, float> a, int64_t BV) {
  extern __shared__ __align__(128) unsigned char kda_tc_shared[];
  simt::kda_chunk_backward_scan_tc<simt::DeviceTf32>(DeviceBlock{simt::kKdaTcThreads}, a, blockIdx.x,
                                                     static_cast<int64_t>(blockIdx.y) * BV, BV,
                                                     reinterpret_cast<float*>(kda_tc_shared));
}

template <class T>
__global__ void __launch_bounds__(kThreads) kda_chunk_prepare_tc_kernel(simt::KdaChunkArgs<T, float> a) {
  extern __shared__ __align__(16) unsigned char kda_shared[];
  const int64_t chunks = a.chunks(), block = blockIdx.x;
  simt::kda_chunk_prepare<simt::DeviceTf32>(DeviceBlock{kThreads}, a, block / chunks, block % chunks,
                                            reinterpret_cast<float*>(kda_shared));
}

template <class T>
__global__ void __launch_bounds__(kThreads) kda_chunk_grad_tc_kernel(simt::KdaChunkArgs<T, float> a) {
  const int64_t chunks = a.chunks(), block = blockIdx.x;
  simt::kda_chunk_grad<simt::DeviceTf32>(DeviceBlock{kThreads}, a, block / chunks, block % chunks);
}

std::atomic<bool> g_kda_tensor_cores{false};
std::atomic<int> g_kda_scan_columns{0};  // 0: kda_scan_columns' choice

// The scans' column tile (ops/kda/kda_tc.h: kda_scan_columns) for this device's multiprocessors.
int64_t scan_columns(int64_t tasks, int64_t V, simt::KdaScanPath path) {
  return simt::kda_scan_columns(tasks, V, device_attribute(cudaDevAttrMultiProcessorCount), path,
                                g_kda_scan_columns.load());
}

// Whether a chunked call (f32 arithmetic) of `tasks` scans takes the tensor-core bodies.
bool use_tensor_cores(int64_t tasks, int64_t K, int64_t V, int64_t C) {
  if (!g_kda_tensor_cores.load() || !simt::kda_tc_shape_ok(K, V, C)) return false;
  const int64_t BV = scan_columns(tasks, V, simt::KdaScanPath::tensor_cores);
  const int64_t need = std::max({simt::kda_tc_scan_shared_elements(K, C, BV),
                                 simt::kda_tc_backward_scan_shared_elements(K, C, BV),
                                 simt::kda_tc_output_shared_elements(C, V)}) *
                       static_cast<int64_t>(sizeof(float));
  return has_tensor_cores() && need <= max_shared_bytes();
}

// Shapes, scale and input pointers of either body's arguments (g, beta may be null).
template <class T, class A>
void set_inputs(simt::KdaInputs<T, A>& a, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor* g,
                const Tensor* beta, double scale) {
  a.B = q.size(0);
  a.Tn = q.size(1);
  a.H = q.size(2);
  a.K = q.size(3);
  a.HV = v.size(2);
  a.V = v.size(3);
  a.scale = static_cast<A>(scale);
  a.q = ptr<T>(q);
  a.k = ptr<T>(k);
  a.v = ptr<T>(v);
  a.g = g ? ptr<T>(*g) : nullptr;
  a.beta = beta ? ptr<T>(*beta) : nullptr;
}

// One chunked call's arguments and the scratch of kda_chunk_prepare (plus A^kk's
// β-free part for a backward), [tasks, chunks, ...] in the arithmetic type.
template <class T, class A>
struct ChunkRun {
  simt::KdaChunkArgs<T, A> a;
  DType acc = dtype_of<A>::value;
  Device device;
  int64_t tasks, chunks;
  int columns;  // threads of a scalar scan block: its tile of columns of S
  size_t shared;
  Tensor gamma, Aqk, N, W, Qd, Kd, U, Vnew, decay, Ekk, work;

  ChunkRun(const char* op, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
           double scale, int64_t chunk_size, bool backward)
      : device(q.device()) {
    set_inputs(a, q, k, v, &g, &beta, scale);
    a.C = chunk_size;
    tasks = a.tasks();
    chunks = a.chunks();
    const int64_t C = a.C, K = a.K, V = a.V;
    shared = static_cast<size_t>(simt::kda_chunk_shared_elements(C)) * sizeof(A);
    MT_CHECK(shared <= 48 * 1024,
             "{}: chunk_size = {} needs {} bytes of shared memory per block; the CUDA kernel has 48 KiB (64 is the "
             "usual choice)", op, C, shared);
    MT_CHECK(tasks * chunks <= 0x7fffffff, "{}: {} (batch, head, chunk) blocks exceed the CUDA grid", op,
             tasks * chunks);
    columns = static_cast<int>(scan_columns(tasks, V, simt::KdaScanPath::scalar));
    gamma = empty({tasks, chunks, C * K}, DType::f64, device);
    Aqk = scratch(C * C);
    N = scratch(C * C);
    W = scratch(C * K);
    Qd = scratch(C * K);
    Kd = scratch(C * K);
    U = scratch(C * V);
    Vnew = scratch(C * V);
    decay = scratch(K);
    work = empty({tasks, K, V}, acc, device);
    if (backward) Ekk = scratch(C * C);
    a.gamma = ptr<double>(gamma);
    a.Aqk = ptr<A>(Aqk);
    a.N = ptr<A>(N);
    a.W = ptr<A>(W);
    a.Qd = ptr<A>(Qd);
    a.Kd = ptr<A>(Kd);
    a.U = ptr<A>(U);
    a.Vnew = ptr<A>(Vnew);
    a.decay = ptr<A>(decay);
    a.work = ptr<A>(work);
    a.Ekk = backward ? ptr<A>(Ekk) : nullptr;
  }
  // [tasks, chunks, per] of the arithmetic type.
  Tensor scratch(int64_t per) const { return empty({tasks, chunks, per}, acc, device); }
  Tensor check_states(const Tensor& states) const {
    MT_CHECK(states.dtype() == acc && states.numel() == tasks * chunks * a.K * a.V,
             "kda_chunked: chunk_states {} {}; expected {} with [B, HV, chunks, K, V] = {} elements", states.shape(),
             states.dtype(), acc, tasks * chunks * a.K * a.V);
    return states;
  }
  LaunchDims scan_grid() const { return LaunchDims(tasks, (a.V + columns - 1) / columns); }
  LaunchDims tc_scan_grid(int64_t BV) const { return LaunchDims(tasks, a.V / BV); }
  // tensor_cores: W and U as TF32 tile products (f32 arithmetic only).
  void prepare(cudaStream_t s, bool tensor_cores) const {
    if (chunks == 0) return;
    const int64_t blocks = tasks * chunks;
    if constexpr (std::is_same_v<A, float>) {
      if (tensor_cores) {
        launch("kda_chunk_prepare_tc_kernel", kda_chunk_prepare_tc_kernel<T>, blocks, kThreads, shared, s, a);
        return;
      }
    }
    launch("kda_chunk_prepare_kernel", kda_chunk_prepare_kernel<T, A>, blocks, kThreads, shared, s, a);
  }
};

// Threads per block: the larger of K and V in warps, at most 256 (the bodies stride over the rest).
int block_threads(int64_t K, int64_t V) {
  int64_t m = (std::max(K, V) + 31) / 32 * 32;
  return static_cast<int>(std::clamp<int64_t>(m, 32, 256));
}

template <class T, class A>
KdaSimtArgs<T, A> args_of(const char* op, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor* g,
                          const Tensor* beta, double scale) {
  KdaSimtArgs<T, A> a;
  set_inputs(a, q, k, v, g, beta, scale);
  a.segment = cpu::kKdaRecurrentSegment;
  a.delta_rule = g != nullptr;
  size_t shared = static_cast<size_t>(simt::kda_simt_shared_elements(a.K, a.V)) * sizeof(A);
  MT_CHECK(shared <= 48 * 1024, "{}: K = {}, V = {} need {} bytes of shared memory per block; the CUDA kernel has 48 KiB",
           op, a.K, a.V, shared);
  MT_CHECK(a.tasks() <= 0x7fffffff, "{}: {} (batch, head) tasks exceed the CUDA grid", op, a.tasks());
  return a;
}

template <class T, class A>
void launch_forward(const char* op, KdaSimtArgs<T, A>& a, Tensor& o, Tensor& state, Tensor* checkpoints,
                    const Tensor& q) {
  const DType acc = dtype_of<A>::value;
  Tensor work = empty({a.tasks(), a.K, a.V}, acc, q.device());
  if (checkpoints)
    MT_CHECK(checkpoints->dtype() == acc && checkpoints->numel() == a.tasks() * a.segments() * a.K * a.V,
             "{}: checkpoints {} {}; expected {} with [B, HV, segments, K, V] = {} elements", op,
             checkpoints->shape(), checkpoints->dtype(), acc, a.tasks() * a.segments() * a.K * a.V);
  a.o = ptr<T>(o);
  a.state = ptr<T>(state);
  a.work = ptr<A>(work);
  a.checkpoints = checkpoints ? ptr<A>(*checkpoints) : nullptr;
  if (a.tasks() == 0) return;
  const int threads = block_threads(a.K, a.V);
  const size_t shared = static_cast<size_t>(simt::kda_simt_shared_elements(a.K, a.V)) * sizeof(A);
  launch("kda_forward_kernel", kda_forward_kernel<T, A>, a.tasks(), threads, shared, stream_of(q), a);
}

// grad_q/grad_k [B, T, H, K] from the per-value-head sums; grad_v, grad_g, grad_beta and grad_h0 in place.
template <class T, class A>
void launch_backward(const char* op, KdaSimtArgs<T, A>& a, Tensor& grad_q, Tensor& grad_k, Tensor& grad_v,
                     Tensor* grad_g, Tensor* grad_beta, Tensor& grad_h0, const Tensor& grad_o,
                     const Tensor& grad_final_state, const Tensor& checkpoints, const Tensor& q) {
  const DType acc = dtype_of<A>::value;
  MT_CHECK(checkpoints.dtype() == acc && checkpoints.numel() == a.tasks() * a.segments() * a.K * a.V,
           "{}: checkpoints {} {}; expected {} with [B, HV, segments, K, V] = {} elements", op, checkpoints.shape(),
           checkpoints.dtype(), acc, a.tasks() * a.segments() * a.K * a.V);
  Tensor grad_o_c = grad_o.contiguous(), grad_state_c = grad_final_state.contiguous();
  Tensor states = empty({a.tasks(), a.segment + 1, a.K, a.V}, acc, q.device());
  Tensor deltas = empty({a.tasks(), a.segment, a.V}, acc, q.device());
  Tensor dS = empty({a.tasks(), a.K, a.V}, acc, q.device());
  Tensor dq = empty({a.B, a.Tn, a.HV, a.K}, acc, q.device()), dk = empty({a.B, a.Tn, a.HV, a.K}, acc, q.device());
  a.checkpoints = ptr<A>(checkpoints);
  a.grad_o = ptr<T>(grad_o_c);
  a.grad_state = ptr<T>(grad_state_c);
  a.states = ptr<A>(states);
  a.deltas = ptr<A>(deltas);
  a.dS = ptr<A>(dS);
  a.dq = ptr<A>(dq);
  a.dk = ptr<A>(dk);
  a.grad_v = ptr<T>(grad_v);
  a.grad_g = grad_g ? ptr<T>(*grad_g) : nullptr;
  a.grad_beta = grad_beta ? ptr<T>(*grad_beta) : nullptr;
  a.grad_state0 = ptr<T>(grad_h0);
  if (a.tasks() == 0) return;
  cudaStream_t s = stream_of(q);
  const int threads = block_threads(a.K, a.V);
  const size_t shared = static_cast<size_t>(simt::kda_simt_shared_elements(a.K, a.V)) * sizeof(A);
  launch("kda_backward_kernel", kda_backward_kernel<T, A>, a.tasks(), threads, shared, s, a);
  const int64_t n = a.B * a.Tn * a.H * a.K, G = a.HV / a.H;
  if (n > 0) {
    launch("group_sum_kernel", group_sum_kernel<T, A>, blocks_for(n), kThreads, 0, s, ptr<T>(grad_q), ptr<A>(dq), n, G,
           a.K);
    launch("group_sum_kernel", group_sum_kernel<T, A>, blocks_for(n), kThreads, 0, s, ptr<T>(grad_k), ptr<A>(dk), n, G,
           a.K);
  }
}

}  // namespace

void kda_recurrent_forward(Tensor& o, Tensor& state, Tensor* checkpoints, const Tensor& q, const Tensor& k,
                           const Tensor& v, const Tensor& g, const Tensor& beta, double scale) {
  dispatch_float_cuda(q.dtype(), "kda_recurrent", [&](auto tag) {
    using T = decltype(tag);
    using A = acc_t<T>;
    KdaSimtArgs<T, A> a = args_of<T, A>("kda_recurrent", q, k, v, &g, &beta, scale);
    launch_forward("kda_recurrent", a, o, state, checkpoints, q);
  });
}

void kda_recurrent_backward(Tensor& grad_q, Tensor& grad_k, Tensor& grad_v, Tensor& grad_g, Tensor& grad_beta,
                            Tensor& grad_h0, const Tensor& grad_o, const Tensor& grad_final_state, const Tensor& q,
                            const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                            const Tensor& checkpoints, double scale) {
  dispatch_float_cuda(q.dtype(), "kda_recurrent_backward", [&](auto tag) {
    using T = decltype(tag);
    using A = acc_t<T>;
    KdaSimtArgs<T, A> a = args_of<T, A>("kda_recurrent_backward", q, k, v, &g, &beta, scale);
    launch_backward("kda_recurrent_backward", a, grad_q, grad_k, grad_v, &grad_g, &grad_beta, grad_h0, grad_o,
                    grad_final_state, checkpoints, q);
  });
}

void kda_chunked_forward(Tensor& o, Tensor& state, Tensor* chunk_states, const Tensor& q, const Tensor& k,
                         const Tensor& v, const Tensor& g, const Tensor& beta, double scale, int64_t chunk_size) {
  dispatch_float_cuda(q.dtype(), "kda_chunked", [&](auto tag) {
    using T = decltype(tag);
    using A = acc_t<T>;
    ChunkRun<T, A> run("kda_chunked", q, k, v, g, beta, scale, chunk_size, false);
    simt::KdaChunkArgs<T, A>& a = run.a;
    Tensor states = chunk_states ? run.check_states(*chunk_states) : run.scratch(a.K * a.V);
    a.o = ptr<T>(o);
    a.state = ptr<T>(state);
    a.states = ptr<A>(states);
    if (a.tasks() == 0) return;
    cudaStream_t s = stream_of(q);
    const bool tensor_cores = std::is_same_v<A, float> && use_tensor_cores(run.tasks, a.K, a.V, a.C);
    run.prepare(s, tensor_cores);
    if constexpr (std::is_same_v<A, float>) {
      if (tensor_cores) {
        const int64_t BV = scan_columns(run.tasks, a.V, simt::KdaScanPath::tensor_cores);
        launch_with_shared(kda_chunk_scan_tc_kernel<T>, run.tc_scan_grid(BV), simt::kKdaTcThreads,
                           simt::kda_tc_scan_shared_elements(a.K, a.C, BV) * sizeof(float), s,
                           "kda_chunked (tensor cores)", "a smaller K", a, BV);
        if (run.chunks > 0)
          launch_with_shared(kda_chunk_output_tc_kernel<T>, run.tasks * run.chunks, simt::kKdaTcThreads,
                             simt::kda_tc_output_shared_elements(a.C, a.V) * sizeof(float), s,
                             "kda_chunked (tensor cores)", "a smaller V", a);
        return;
      }
    }
    launch("kda_chunk_scan_kernel", kda_chunk_scan_kernel<T, A>, run.scan_grid(), run.columns, 0, s, a);
    if (run.chunks > 0)
      launch("kda_chunk_output_kernel", kda_chunk_output_kernel<T, A>, run.tasks * run.chunks, kThreads, 0, s, a);
  });
}

void kda_chunked_backward(Tensor& grad_q, Tensor& grad_k, Tensor& grad_v, Tensor& grad_g, Tensor& grad_beta,
                          Tensor& grad_h0, const Tensor& grad_o, const Tensor& grad_final_state, const Tensor& q,
                          const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                          const Tensor& chunk_states, double scale, int64_t chunk_size) {
  dispatch_float_cuda(q.dtype(), "kda_chunked_backward", [&](auto tag) {
    using T = decltype(tag);
    using A = acc_t<T>;
    ChunkRun<T, A> run("kda_chunked_backward", q, k, v, g, beta, scale, chunk_size, true);
    simt::KdaChunkArgs<T, A>& a = run.a;
    const int64_t C = a.C, K = a.K, V = a.V;
    Tensor states = run.check_states(chunk_states);
    Tensor grad_o_c = grad_o.contiguous(), grad_state_c = grad_final_state.contiguous();
    Tensor dS = empty({run.tasks, K, V}, run.acc, q.device());
    Tensor dS_exit = run.scratch(K * V), dVnew = run.scratch(C * V);
    Tensor dW = run.scratch(C * K), dKd = run.scratch(C * K), dOS = run.scratch(C * K), dKe = run.scratch(C * K),
           dgamma = run.scratch(C * K);
    Tensor dAqk = run.scratch(C * C), dTm = run.scratch(C * C), Y = run.scratch(C * C),
           dAkk = run.scratch(C * C), dbeta = run.scratch(2 * C);
    Tensor dq = empty({a.B, a.Tn, a.HV, K}, run.acc, q.device()), dk = empty({a.B, a.Tn, a.HV, K}, run.acc, q.device());
    a.states = ptr<A>(states);
    a.grad_o = ptr<T>(grad_o_c);
    a.grad_state = ptr<T>(grad_state_c);
    a.dS = ptr<A>(dS);
    a.dS_exit = ptr<A>(dS_exit);
    a.dVnew = ptr<A>(dVnew);
    a.dW = ptr<A>(dW);
    a.dKd = ptr<A>(dKd);
    a.dOS = ptr<A>(dOS);
    a.dKe = ptr<A>(dKe);
    a.dgamma = ptr<A>(dgamma);
    a.dAqk = ptr<A>(dAqk);
    a.dTm = ptr<A>(dTm);
    a.Y = ptr<A>(Y);
    a.dAkk = ptr<A>(dAkk);
    a.dbeta = ptr<A>(dbeta);
    a.dq = ptr<A>(dq);
    a.dk = ptr<A>(dk);
    a.grad_v = ptr<T>(grad_v);
    a.grad_g = ptr<T>(grad_g);
    a.grad_beta = ptr<T>(grad_beta);
    a.grad_state0 = ptr<T>(grad_h0);
    if (a.tasks() == 0) return;
    cudaStream_t s = stream_of(q);
    const bool tensor_cores = std::is_same_v<A, float> && use_tensor_cores(run.tasks, a.K, a.V, a.C);
    run.prepare(s, tensor_cores);
    if constexpr (std::is_same_v<A, float>) {
      if (tensor_cores) {
        const int64_t BV = scan_columns(run.tasks, a.V, simt::KdaScanPath::tensor_cores);
        launch_with_shared(kda_chunk_backward_scan_tc_kernel<T>, run.tc_scan_grid(BV), simt::kKdaTcThreads,
                           simt::kda_tc_backward_scan_shared_elements(a.K, a.C, BV) * sizeof(float), s,
                           "kda_chunked_backward (tensor cores)", "a smaller K", a, BV);
      }
    }
    if (!tensor_cores)
      launch("kda_chunk_backward_scan_kernel", kda_chunk_backward_scan_kernel<T, A>, run.scan_grid(), run.columns, 0, s,
             a);
    if (run.chunks > 0) {
      const int64_t blocks = run.tasks * run.chunks;
      if constexpr (std::is_same_v<A, float>) {
        if (tensor_cores) launch("kda_chunk_grad_tc_kernel", kda_chunk_grad_tc_kernel<T>, blocks, kThreads, 0, s, a);
      }
      if (!tensor_cores) launch("kda_chunk_grad_kernel", kda_chunk_grad_kernel<T, A>, blocks, kThreads, 0, s, a);
    }
    const int64_t n = a.B * a.Tn * a.H * K, G = a.HV / a.H;
    if (n > 0) {
      launch("group_sum_kernel", group_sum_kernel<T, A>, blocks_for(n), kThreads, 0, s, ptr<T>(grad_q), ptr<A>(dq), n,
             G, K);
      launch("group_sum_kernel", group_sum_kernel<T, A>, blocks_for(n), kThreads, 0, s, ptr<T>(grad_k), ptr<A>(dk), n,
             G, K);
    }
  });
}

void set_kda_tensor_cores(bool enabled) { g_kda_tensor_cores.store(enabled); }

void set_kda_scan_columns(int columns) {
  MT_CHECK(columns == 0 || columns == 8 || columns == 16 || columns == 32 || columns == 64,
           "set_kda_scan_columns: {} columns; expected 8, 16, 32, 64 or 0 (the automatic choice)", columns);
  g_kda_scan_columns.store(columns);
}

int kda_chunked_scan_columns(int64_t tasks, int64_t K, int64_t V, int64_t chunk_size) {
  const bool tensor_cores = use_tensor_cores(tasks, K, V, chunk_size);
  return static_cast<int>(
      scan_columns(tasks, V, tensor_cores ? simt::KdaScanPath::tensor_cores : simt::KdaScanPath::scalar));
}

void linear_attention_forward(Tensor& o, Tensor& state, Tensor* checkpoints, const Tensor& q, const Tensor& k,
                              const Tensor& v) {
  dispatch_float_cuda(q.dtype(), "linear_attention", [&](auto tag) {
    using T = decltype(tag);
    using A = acc_t<T>;
    KdaSimtArgs<T, A> a = args_of<T, A>("linear_attention", q, k, v, nullptr, nullptr, 1.0);
    launch_forward("linear_attention", a, o, state, checkpoints, q);
  });
}

void linear_attention_backward(Tensor& grad_q, Tensor& grad_k, Tensor& grad_v, Tensor& grad_h0, const Tensor& grad_o,
                               const Tensor& grad_final_state, const Tensor& q, const Tensor& k, const Tensor& v,
                               const Tensor& checkpoints) {
  dispatch_float_cuda(q.dtype(), "linear_attention_backward", [&](auto tag) {
    using T = decltype(tag);
    using A = acc_t<T>;
    KdaSimtArgs<T, A> a = args_of<T, A>("linear_attention_backward", q, k, v, nullptr, nullptr, 1.0);
    launch_backward("linear_attention_backward", a, grad_q, grad_k, grad_v, nullptr, nullptr, grad_h0, grad_o,
                    grad_final_state, checkpoints, q);
  });
}

}  // namespace moetrain::cuda
