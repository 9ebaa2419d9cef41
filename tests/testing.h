// Test helpers: finite-difference gradient checks, tensor comparisons, and the
// file-system chores of tests that write files or run commands.
#pragma once

#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include <catch2/catch.hpp>

#include "backend/cpu/denormals.h"
#include "backend/cpu/isa.h"
#include "core/tensor.h"
#include "nn/parameters.h"

namespace moetrain::testing {

struct GradCheckOptions {
  double eps = 1e-6;            // central-difference step
  double tolerance = 1e-6;      // max relative error allowed
  double floor = 1e-3;          // relative error = |a - n| / max(|a|, |n|, floor)
  std::vector<bool> check;      // which inputs to check (default: all floating ones)
  uint64_t seed = 12345;        // of the random upstream gradient
};

struct GradCheckResult {
  double max_rel_error = 0;
  std::string worst;  // "input 1 element 7: analytic .. numeric .."
};

// Checks the gradients of fn at `inputs` (f64 tensors) against central finite
// differences of L = sum_k <w_k, fn(inputs)_k> with random weights w_k, and
// REQUIREs the max relative error to be below opts.tolerance.
GradCheckResult check_gradients(const std::function<Tensors(const Tensors&)>& fn, const Tensors& inputs,
                                GradCheckOptions opts = {});
GradCheckResult check_gradients(const std::function<Tensor(const Tensors&)>& fn, const Tensors& inputs,
                                GradCheckOptions opts = {});

// Central differences (step 1e-6) of loss() for three elements (first, middle,
// last) of every f64 parameter, against the gradients of one backward of loss():
// the worst relative error (denominator at least 1e-3) and where it occurred.
GradCheckResult check_parameter_gradients(ParameterList& params, const std::function<Tensor()>& loss);

double max_abs_diff(const Tensor& a, const Tensor& b);

// [cuda] tests start with `if (!gpu_available()) return;`: false when no CUDA
// device is visible (or the build has no CUDA); the first such call of a process
// prints one line saying the [cuda] tests are skipped and why.
bool gpu_available();
// max |a - b| / max |b|: the error relative to the scale of the reference b
// (the absolute error when b is all zero); a NaN on either side is an infinite
// error (std::max would otherwise pass over it). cuda_vs_cpu.h's rel_error_nan
// accepts NaN where both have it.
double rel_error(const Tensor& a, const Tensor& b);
// Bitwise equality of shape, dtype and contents.
bool bitwise_equal(const Tensor& a, const Tensor& b);

// The vector copies this CPU runs (backend/cpu/isa.h): generic, then avx2 and avx512
// where the CPU has them.
std::vector<cpu::VectorIsa> runnable_isas();
// run(dtype) returns an op's outputs and gradients. Runs it in f64, then in f32 in every
// copy this CPU runs (cap_vector_isa_for_testing), and checks each copy's tensors within
// rel_tol (rel_error) of the f64 ones and, where both run, the AVX2 and AVX-512 copies
// bit for bit equal (the same FMAs per element, only the vector width differs).
void check_vector_copies(const std::function<std::vector<Tensor>(DType)>& run, double rel_tol);

// A fresh directory under $TMPDIR (or /tmp), removed with its contents at scope exit.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const std::string& path() const { return path_; }
  std::string operator/(std::string_view name) const { return path_ + "/" + std::string(name); }
  std::string file(std::string_view name) const { return *this / name; }
  // Writes `bytes` to `name` (creating subdirectories) and returns the full path.
  std::string write(std::string_view name, std::string_view bytes) const;
  // The names in the directory, sorted.
  std::vector<std::string> listing() const;

 private:
  std::string path_;
};

std::string read_bytes(const std::string& path);
void write_bytes(const std::string& path, std::string_view bytes);
// Runs `command` with /bin/sh; its exit status, or -1 if it did not exit normally.
int run_command(const std::string& command);
struct CommandOutput {
  int code;            // exit status; -1 if the command did not exit normally
  std::string output;  // what it printed (stdout, plus stderr when merged)
};
// Runs `command` with /bin/sh and captures its output (stderr too when merge_stderr).
CommandOutput capture_command(const std::string& command, bool merge_stderr = true);
// Runs the moetrain binary of this build with `args` (capture_command).
CommandOutput run_moetrain(const std::string& args, bool merge_stderr = true);
// Single-quotes a string for /bin/sh.
std::string shell_quote(std::string_view s);

// mpirun for tests on this machine, followed by "-np N ...": as root,
// oversubscribed, shared memory only (no CMA), one thread per rank.
inline constexpr const char* kLocalMpirun =
    "mpirun --allow-run-as-root --oversubscribe --bind-to none --mca btl self,vader "
    "--mca btl_vader_single_copy_mechanism none -x OMP_NUM_THREADS=1 ";
// A run's metrics.jsonl without its timing fields (everything from "tok_per_s"
// on) and run ids: what two runs of the same computation must agree on to the bit.
std::string metrics_history(const std::string& run_dir);
// The "loss" of every record of a run's metrics.jsonl that has one.
std::vector<double> metrics_losses(const std::string& run_dir);

// Byte-level tinyshakespeare shards in <dir>/data (8192 validation tokens), made
// by `moetrain prepare`; REQUIREs that it worked.
void prepare_byte_shards(const std::string& dir);
// `moetrain train` arguments of a tiny byte-level GPT-2 (2 layers, d_model 32) on
// the shards of prepare_byte_shards(dir): batches of 4 x 32 tokens, one thread,
// no validation or samples, a log line every 1000 steps.
std::string tiny_gpt2_train_args(const std::string& dir, const std::string& run_dir, int steps);
// The shipped configs (configs/*.yaml) that train in one process on the CPU: not
// kimi-k3, k3-scaled, k3-scaled-lite (billions of parameters) nor k3-base (an include).
const std::vector<std::string>& one_process_configs();
// `train -c configs/<config>.yaml` for 2 short steps (batch 1, 16 tokens, warmup 1, one
// thread, train.ep 1, no evaluation or samples) on the byte shards prepare_byte_shards(dir)
// wrote, into run_dir.
std::string short_config_run_args(const std::string& config, const std::string& dir, const std::string& run_dir);

// The what() of the exception of type E that fn throws; fails the test otherwise.
// Subnormals kept for the guard's scope (no FTZ/DAZ in this thread and the OpenMP
// pool), the previous mode restored after: for tests of exact IEEE conversions whose
// inputs or by-value references are subnormal. The process flushes them by default
// (backend/cpu/denormals.h, MOETRAIN_DENORMALS), which reads such a value as 0.
class KeepDenormals {
 public:
  KeepDenormals() : previous_(cpu::denormal_mode()) { cpu::set_denormal_mode(cpu::DenormalMode::keep); }
  ~KeepDenormals() { cpu::set_denormal_mode(previous_); }
  KeepDenormals(const KeepDenormals&) = delete;
  KeepDenormals& operator=(const KeepDenormals&) = delete;

 private:
  cpu::DenormalMode previous_;
};

template <class E = Error, class F>
std::string error_of(F&& fn) {
  try {
    fn();
  } catch (const E& e) {
    return e.what();
  } catch (const std::exception& e) {
    FAIL_CHECK("expected another exception type, got: " << e.what());
    return "";
  }
  FAIL_CHECK("expected an exception, nothing was thrown");
  return "";
}

}  // namespace moetrain::testing
