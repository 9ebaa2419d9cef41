// Subnormal floats on the CPU: flush-to-zero (FTZ) and denormals-are-zero (DAZ).
//
// Intel cores take a microcode assist (~100+ cycles) for every SSE/AVX operation
// that reads a subnormal operand or makes a subnormal result; KDA's decayed
// products make many of them and ran 10x slower on an Intel Xeon (issue 38). With
// FTZ a result below the smallest normal number (2^-126 in f32, 2^-1022 in f64)
// is written as a zero of its sign; with DAZ a subnormal input is read as zero.
// Nothing else changes: normal numbers, rounding, inf and nan are as before.
// docs/performance.md, "Denormals".
//
// MOETRAIN_DENORMALS=flush (default) | keep, read by init_threads()
// (backend/cpu/parallel.h) at start-up. The mode is a bit of each thread's
// MXCSR register, so it is set in the main thread and in every OpenMP worker
// (the pool our kernels, OpenBLAS's OpenMP build and BLIS's OpenMP build all run
// on); threads started later (more OpenMP workers, MPI's and the watchdog's
// threads, the checkpoint writer) inherit their creator's MXCSR on Linux. x86-64
// only: elsewhere (aarch64) the mode is recorded but nothing is set.
#pragma once

#include <string>

namespace moetrain::cpu {

enum class DenormalMode { flush, keep };

// MOETRAIN_DENORMALS: unset or empty -> flush; a value other than flush / keep
// throws, naming the variable.
DenormalMode denormal_mode_from_env();
// Sets the mode in the calling thread and in the OpenMP pool (a parallel region as
// wide as the widest thread count set so far); set_num_threads() applies it to a
// wider pool. init_threads() applies denormal_mode_from_env().
void set_denormal_mode(DenormalMode mode);
// The mode last set (flush before any call).
DenormalMode denormal_mode();
// Sets the current mode in the calling thread only (for threads we start ourselves
// before any mode was chosen; the others inherit it).
void apply_denormal_mode_to_this_thread();
// Whether the calling thread's MXCSR has FTZ and DAZ set (false off x86-64).
bool this_thread_flushes_denormals();
// The largest thread count set_num_threads() was given (1 before any call;
// backend/cpu/threads.cpp): the pool width set_denormal_mode() covers.
int widest_thread_count();
// "flush" / "keep".
const char* denormal_mode_name(DenormalMode mode);
// For `moetrain info`, e.g. "flush (MOETRAIN_DENORMALS=flush): FTZ+DAZ in the main
// thread and the OpenMP pool; results below 2^-126 (f32) / 2^-1022 (f64) are 0".
std::string denormal_description();

}  // namespace moetrain::cpu
