#include <sched.h>
#include <unistd.h>

#include <cstdlib>
#include <mutex>
#include <string>

#include <spdlog/spdlog.h>

#include "backend/cpu/blas.h"
#include "backend/cpu/denormals.h"
#include "backend/cpu/parallel.h"
#include "core/error.h"

namespace moetrain::cpu {

namespace {
int g_threads = 0;
int g_widest = 1;  // the widest thread count set so far

// A positive integer from the environment, 0 when unset. Strict variables must be
// exactly an integer; the launchers' own (e.g. SLURM's "2(x3)") are read leniently.
int env_int(const char* name, bool strict) {
  const char* v = std::getenv(name);
  if (!v || !*v) return 0;
  char* end = nullptr;
  long n = std::strtol(v, &end, 10);
  if (strict) MT_CHECK(*end == '\0' && n > 0, "environment variable {}={} is not a positive integer", name, v);
  return n > 0 ? static_cast<int>(n) : 0;
}
}  // namespace

int num_threads() { return g_threads > 0 ? g_threads : omp_get_max_threads(); }

void set_num_threads(int n) {
  MT_CHECK(n >= 1, "thread count must be >= 1, got {}", n);
  g_threads = n;
  omp_set_num_threads(n);
  set_blas_threads(n);
  // A wider pool: its new workers copy the MXCSR of the thread that starts them
  // (ours), but set the mode explicitly rather than rely on that.
  if (n > g_widest) {
    g_widest = n;
    set_denormal_mode(denormal_mode());
  }
}

int widest_thread_count() { return g_widest; }

int usable_cores() {
  cpu_set_t set;
  return std::max(1, sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : omp_get_num_procs());
}

int capped_thread_count(int64_t requested, const std::string& what) {
  MT_CHECK(requested >= 1, "{}: the thread count must be >= 1, got {}", what, requested);
  const int cores = usable_cores();
  const int64_t cap = int64_t{kMaxThreadsPerCore} * cores;
  if (requested <= cap) return static_cast<int>(requested);
  spdlog::warn("{} = {} threads, but this process may use {} core{}: using {} ({} per core; more only make the "
               "threads wait for each other)", what, requested, cores, cores == 1 ? "" : "s", cap, kMaxThreadsPerCore);
  return static_cast<int>(cap);
}

int default_num_threads() {
  if (int n = env_int("MOETRAIN_NUM_THREADS", true)) return capped_thread_count(n, "MOETRAIN_NUM_THREADS");
  const int cores = usable_cores();
  int ranks = 1;
  for (const char* var : {"OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE"}) {
    if (int r = env_int(var, false)) {
      ranks = r;
      break;
    }
  }
  return std::max(1, cores / ranks);
}

int launcher_local_rank() {
  for (const char* var : {"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID"})
    if (const char* v = std::getenv(var); v && *v) return std::atoi(v);
  return 0;
}

std::vector<int> pin_threads() {
  cpu_set_t allowed;
  MT_CHECK(sched_getaffinity(0, sizeof(allowed), &allowed) == 0, "pin_threads: sched_getaffinity failed");
  std::vector<int> cpus;
  for (int c = 0; c < CPU_SETSIZE; ++c)
    if (CPU_ISSET(c, &allowed)) cpus.push_back(c);
  const int local_rank = launcher_local_rank();
  const int n = num_threads();
  std::vector<int> chosen(static_cast<size_t>(n), -1);
#pragma omp parallel num_threads(n)
  {
    const int t = omp_get_thread_num();
    const int cpu = cpus[static_cast<size_t>(local_rank * n + t) % cpus.size()];
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(cpu, &one);
    if (sched_setaffinity(0, sizeof(one), &one) == 0) chosen[static_cast<size_t>(t)] = cpu;
  }
  return chosen;
}

void reexec_with_short_spin(char** argv) {
  if (std::getenv("OMP_WAIT_POLICY") || std::getenv("GOMP_SPINCOUNT")) return;
  char path[4096];
  ssize_t n = readlink("/proc/self/exe", path, sizeof(path) - 1);
  if (n <= 0) return;  // no procfs: run on with libgomp's default
  path[n] = '\0';
  setenv("GOMP_SPINCOUNT", kDefaultSpinCount, 1);
  execv(path, argv);
  unsetenv("GOMP_SPINCOUNT");  // exec failed: libgomp's default stays in force
}

void init_threads() {
  static std::once_flag once;
  std::call_once(once, [] {
    const DenormalMode denormals = denormal_mode_from_env();
    set_num_threads(default_num_threads());
    set_denormal_mode(denormals);
    const char* pin = std::getenv("MOETRAIN_PIN_THREADS");
    if (pin && *pin) {
      MT_CHECK(std::string(pin) == "0" || std::string(pin) == "1",
               "environment variable MOETRAIN_PIN_THREADS={} is not 0 or 1", pin);
      if (std::string(pin) == "1") pin_threads();
    }
  });
}

}  // namespace moetrain::cpu
