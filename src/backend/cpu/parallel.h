// CPU threading: one knob for OpenMP and OpenBLAS, and the deterministic
// parallel_for of core/parallel.h (included here: kernels include this file).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/parallel.h"

namespace moetrain::cpu {

// num_threads() (core/parallel.h): the threads of our kernels and of OpenBLAS.
// Sets both OpenMP's and OpenBLAS's thread count (n >= 1).
void set_num_threads(int n);
// Default: MOETRAIN_NUM_THREADS if set, else cores available to this process
// divided by the ranks on this node (OMPI_COMM_WORLD_LOCAL_SIZE etc.), at least 1.
int default_num_threads();
// The cores this process may run on (its affinity mask).
int usable_cores();
// A thread count from the user: >= 1 (Error naming `what` otherwise), and at most
// kMaxThreadsPerCore x usable_cores(), lowered to that with a warning naming `what`
// (100,000 OpenMP threads exhaust the stacks; they never help).
inline constexpr int kMaxThreadsPerCore = 4;
int capped_thread_count(int64_t requested, const std::string& what);
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

}  // namespace moetrain::cpu
