// CPU threading: one knob for OpenMP and OpenBLAS, and a deterministic
// parallel_for. Work is split into contiguous static chunks, so for a fixed
// thread count every element is computed by the same code path and results are
// bitwise reproducible run to run.
#pragma once

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace moetrain::cpu {

// Threads used by our kernels and by OpenBLAS.
int num_threads();
// Sets both OpenMP's and OpenBLAS's thread count (n >= 1).
void set_num_threads(int n);
// Default: MOETRAIN_NUM_THREADS if set, else cores available to this process
// divided by the ranks on this node (OMPI_COMM_WORLD_LOCAL_SIZE etc.), at least 1.
int default_num_threads();
// OpenMP threads that reach the end of a parallel region first spin before they
// sleep; libgomp spins 300,000 times by default, so when other processes share
// the cores a waiting thread burns the core the straggler needs, and a step can
// take several times longer than on one thread. libgomp reads its settings once,
// when it loads, so a program that wants a shorter spin must start again with it
// set: when neither OMP_WAIT_POLICY nor GOMP_SPINCOUNT is set, this sets
// GOMP_SPINCOUNT=10000 and re-executes the program (same pid, arguments and
// environment otherwise). Call first thing in main. Either variable set by the
// user is left alone.
inline constexpr const char* kDefaultSpinCount = "10000";
void reexec_with_short_spin(char** argv);

// Applies default_num_threads() once, then pins the threads when
// MOETRAIN_PIN_THREADS=1; called by the CLI and the test main.
void init_threads();
// This process's rank among the processes of its node, as its launcher says
// (OMPI_COMM_WORLD_LOCAL_RANK, MPI_LOCALRANKID or SLURM_LOCALID); 0 without one.
// Picks the CPUs of pin_threads() and the GPU of train.device = cuda.
int launcher_local_rank();
// Pins OpenMP thread i (the pool OpenBLAS and BLIS also run on) to one CPU of this
// process's allowed set: the (local_rank * num_threads() + i)-th, wrapping, so ranks
// on one node started without binding (mpirun --bind-to none) take different CPUs.
// Returns the CPU of each thread. Off by default: the OS scheduler does better
// when other work shares the cores.
std::vector<int> pin_threads();

// fn(begin, end) over [0, n) in at most num_threads() contiguous chunks of at
// least `grain` elements. Runs inline when nested or when the work is small.
template <class F>
void parallel_for(int64_t n, int64_t grain, F&& fn) {
  if (n <= 0) return;
  int nt = num_threads();
  int64_t chunks = std::min<int64_t>(nt, (n + grain - 1) / std::max<int64_t>(grain, 1));
  if (chunks <= 1 || omp_in_parallel()) {
    fn(int64_t{0}, n);
    return;
  }
#pragma omp parallel num_threads(static_cast<int>(chunks))
  {
    int64_t c = omp_get_thread_num(), nc = omp_get_num_threads();
    int64_t begin = n * c / nc, end = n * (c + 1) / nc;
    if (begin < end) fn(begin, end);
  }
}

}  // namespace moetrain::cpu
