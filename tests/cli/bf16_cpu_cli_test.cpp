// train.dtype: bf16 on the CPU (issue 38): GPT-2 and the hybrid (k3-tiny) train in
// mixed precision with train.device cpu, and their losses follow the f32 runs'; under
// mpirun with train.zero 1 (the f32 masters sharded) they follow the one-process bf16
// run, and train.pp 2 (with and without virtual stages) follows one process.
//
// Tolerance: a bf16 run rounds its parameters, activations and gradients to 8
// significant bits, so its losses are not the f32 run's; on these toy runs (lr 3e-3,
// 8-12 steps) each step's loss stays within 0.15% (GPT-2) and 0.3% (k3-tiny) of the
// f32 run's: measured on an AMD EPYC Zen 4 (oneDNN brg:avx512_core_bf16) at most 0.03%
// and 0.08%; GPT-2 without the GELU derivative in the bf16 MLP backward (a planted bug)
// is off by 0.29% at step 12. The parallel layouts sum in other orders (bf16
// gradients reduced in f32 buckets, then rounded), so they follow the one-process bf16
// run within 0.1% (measured: at most 2e-5 relative at train.zero 1).
#include <catch2/catch.hpp>

#include <cmath>
#include <string>
#include <vector>

#include "testing.h"

using moetrain::testing::kLocalMpirun;
using moetrain::testing::metrics_losses;
using moetrain::testing::TempDir;
using std::string;

namespace {

using Result = moetrain::testing::CommandOutput;

constexpr double kBf16VsF32Gpt2 = 0.0015, kBf16VsF32Hybrid = 0.003;
constexpr double kLayoutVsOne = 0.001;

struct Bf16Job {
  TempDir tmp;
  string dir = tmp.path();
  Bf16Job() { moetrain::testing::prepare_byte_shards(dir); }

  string gpt2(const string& name, int steps) const {
    return moetrain::testing::tiny_gpt2_train_args(dir, dir + "/" + name, steps) + " --set train.lr=3e-3";
  }
  // k3-tiny at 4 layers (KDA, MLA at layer 3, MoE, AttnRes), short sequences.
  string hybrid(const string& name, int steps) const {
    return "train -c " + string(MOETRAIN_SOURCE_DIR) + "/configs/k3-tiny.yaml --set data.train=" + dir +
           "/data/train_*.bin --set data.val=" + dir +
           "/data/val_*.bin --set train.max_steps=" + std::to_string(steps) +
           " --set train.warmup_steps=2 --set train.batch_size=2 --set train.seq_len=32 --set train.eval_every=0 "
           "--set train.threads=1 --set train.log_every=100 --set model.n_layer=4 --set model.attn_res_block_size=3 "
           "--set run.dir=" +
           dir + "/" + name;
  }
  // `moetrain args` on np ranks, with `env` ("NAME=value ...") set for one process.
  Result run(int np, const string& args, const string& env = "") const {
    const string launcher = np == 1 ? (env.empty() ? string() : "env " + env + " ")
                                    : string(kLocalMpirun) + "-np " + std::to_string(np) + " ";
    return moetrain::testing::capture_command(launcher + string(MOETRAIN_BINARY_DIR) + "/moetrain " + args);
  }
  // run(), required to exit 0 (its output in the message when it does not).
  Result trained(int np, const string& args, const string& env = "") const {
    Result r = run(np, args, env);
    INFO(r.output);
    REQUIRE(r.code == 0);
    return r;
  }
};

void check_follows(const std::vector<double>& got, const std::vector<double>& want, double rel) {
  REQUIRE(got.size() == want.size());
  REQUIRE(!want.empty());
  for (size_t i = 0; i < got.size(); ++i) {
    INFO("loss " << i << ": " << got[i] << " vs " << want[i]);
    CHECK(std::isfinite(got[i]));
    CHECK(std::abs(got[i] - want[i]) <= rel * std::abs(want[i]));
  }
}

}  // namespace

TEST_CASE("cli: GPT-2 and the hybrid train in bf16 on the CPU, their losses following f32", "[cli]") {
  Bf16Job job;
  for (const bool hybrid : {false, true}) {
    INFO(string(hybrid ? "hybrid (k3-tiny)" : "gpt2"));
    const int steps = hybrid ? 8 : 12;
    auto args = [&](const string& name) { return hybrid ? job.hybrid(name, steps) : job.gpt2(name, steps); };
    const string f32 = hybrid ? "h32" : "g32", b16 = hybrid ? "h16" : "g16";
    Result a = job.trained(1, args(f32));
    Result b = job.trained(1, args(b16) + " --set train.dtype=bf16");
    CHECK(b.output.find("mixed precision: bf16 parameters and activations") != string::npos);
    const std::vector<double> want = metrics_losses(job.dir + "/" + f32), got = metrics_losses(job.dir + "/" + b16);
    REQUIRE(want.size() == static_cast<size_t>(steps));
    check_follows(got, want, hybrid ? kBf16VsF32Hybrid : kBf16VsF32Gpt2);
    CHECK(got.back() < got.front());  // it learns
    CHECK(got != want);               // and is not the f32 run
  }
}

TEST_CASE("cli: a bf16 run on the CPU resumes from its checkpoint bit for bit and exports bf16", "[cli]") {
  Bf16Job job;
  const string args = job.gpt2("r1", 6) + " --set train.dtype=bf16 --set ckpt.every=3";
  Result whole = job.trained(1, args);
  const string r1 = job.dir + "/r1", r2 = job.dir + "/r2";
  Result copy =
      moetrain::testing::capture_command("cp -r " + r1 + " " + r2 + " && rm -r " + r2 + "/checkpoints/step_00000006");
  REQUIRE(copy.code == 0);
  Result resumed = job.trained(1, job.gpt2("r2", 6) +
                                  " --set train.dtype=bf16 --set ckpt.every=3 --set "
                                  "ckpt.resume=step_00000003");
  // The checkpoint holds the f32 masters; the resumed run rounds the bf16 parameters from them again.
  CHECK(moetrain::testing::metrics_history(r2) == moetrain::testing::metrics_history(r1));
  Result exported = job.run(1, "export --checkpoint " + r1 + "/model --out " + job.dir + "/exp --dtype bf16");
  INFO(exported.output);
  CHECK(exported.code == 0);
}

TEST_CASE("cli: bf16 runs on the CPU give the same bits at 1 and 2 threads", "[cli]") {
  // oneDNN's products and the widened kernels at these shapes (docs/performance.md,
  // Reproducibility): the written model's bytes and the metrics.
  Bf16Job job;
  for (const bool hybrid : {false, true}) {
    INFO(string(hybrid ? "hybrid (k3-tiny)" : "gpt2"));
    string models[2], histories[2];
    for (int threads : {1, 2}) {
      const string name = string(hybrid ? "h" : "g") + std::to_string(threads);
      const string base = hybrid ? job.hybrid(name, 4) : job.gpt2(name, 4);
      Result r = job.trained(1, base + " --set train.dtype=bf16 --set train.threads=" + std::to_string(threads));
      models[threads - 1] = moetrain::testing::read_bytes(job.dir + "/" + name + "/model/model.safetensors");
      histories[threads - 1] = moetrain::testing::metrics_history(job.dir + "/" + name);
    }
    CHECK(!models[0].empty());
    CHECK(models[0] == models[1]);
    CHECK(histories[0] == histories[1]);
  }
}

TEST_CASE("cli: bf16 on the CPU under mpirun: train.zero 1 at 2 ranks follows one process", "[cli][slow]") {
  Bf16Job job;
  const int steps = 6;
  // One process at the global batch of 2 ranks (grad_accum 2), then 2 data-parallel
  // ranks with ZeRO-1 (the f32 masters and moments sharded): GPT-2, then the hybrid.
  for (const bool hybrid : {false, true}) {
    INFO(string(hybrid ? "hybrid (k3-tiny)" : "gpt2"));
    auto args = [&](const string& name) { return hybrid ? job.hybrid(name, steps) : job.gpt2(name, steps); };
    const string one_dir = hybrid ? "h1" : "g1", zero_dir = hybrid ? "hz" : "gz";
    Result one = job.trained(1, args(one_dir) + " --set train.dtype=bf16 --set train.grad_accum=2");
    Result zero = job.trained(2, args(zero_dir) + " --set train.dtype=bf16 --set train.zero=1");
    CHECK(zero.output.find("mixed precision: bf16 parameters and activations") != string::npos);
    check_follows(metrics_losses(job.dir + "/" + zero_dir), metrics_losses(job.dir + "/" + one_dir), kLayoutVsOne);
  }
}

// A pipeline stage receives bf16 activations (the trainer passes the run's activation
// dtype: LanguageModel::dtype() says f32 in a bf16 run, its parameters converted after
// it was built); it failed with "send_recv: a message from rank 0 has 8192 bytes, 16384
// were expected" before. Also with two virtual stages per rank (train.pp_virtual).
TEST_CASE("cli: bf16 on the CPU with train.pp 2 follows one process", "[cli][slow]") {
  Bf16Job job;
  const int steps = 6;
  Result one = job.trained(1, job.hybrid("h1", steps) + " --set train.dtype=bf16 --set train.grad_accum=2");
  Result pipe = job.trained(2, job.hybrid("hp", steps) + " --set train.dtype=bf16 --set train.pp=2 --set train.grad_accum=2");
  CHECK(pipe.output.find("pp 2") != string::npos);
  check_follows(metrics_losses(job.dir + "/hp"), metrics_losses(job.dir + "/h1"), kLayoutVsOne);
  Result interleaved = job.trained(2, job.hybrid("hv", steps) + " --set train.dtype=bf16 --set train.pp=2 "
                                                            "--set train.pp_virtual=2 --set train.grad_accum=2");
  check_follows(metrics_losses(job.dir + "/hv"), metrics_losses(job.dir + "/h1"), kLayoutVsOne);
  check_follows(metrics_losses(job.dir + "/hp"), metrics_losses(job.dir + "/h1"), kLayoutVsOne);
}

// Expert parallelism in bf16: the tokens' activations cross the all-to-all in bf16 and
// the experts' shards keep f32 masters; at train.ep 2 (and with train.zero 1 on top)
// the hybrid follows the one-process bf16 run at the same global batch.
TEST_CASE("cli: bf16 on the CPU with train.ep 2 follows one process", "[cli][slow]") {
  Bf16Job job;
  const int steps = 6;
  job.trained(1, job.hybrid("h1", steps) + " --set train.dtype=bf16 --set train.grad_accum=2");
  for (const string zero : {"0", "1"}) {
    INFO("train.zero " << zero);
    const string name = "he" + zero;
    Result ep = job.trained(2, job.hybrid(name, steps) + " --set train.dtype=bf16 --set train.ep=2 --set train.zero=" + zero);
    CHECK(ep.output.find("mixed precision: bf16 parameters and activations") != string::npos);
    check_follows(metrics_losses(job.dir + "/" + name), metrics_losses(job.dir + "/h1"), kLayoutVsOne);
  }
}

// Every shipped config that fits one process trains in bf16 (2 steps, finite losses).
TEST_CASE("cli: train.dtype bf16 trains every shipped config that fits one process on the CPU", "[cli][slow]") {
  Bf16Job job;
  for (const string& config : moetrain::testing::one_process_configs()) {
    INFO(config);
    const string run = job.dir + "/" + config;
    const Result r = job.trained(1, moetrain::testing::short_config_run_args(config, job.dir, run) +
                                        " --set model.vocab_size=256 --set train.dtype=bf16");
    CHECK(r.output.find("mixed precision: bf16 parameters and activations") != string::npos);
    const std::vector<double> losses = metrics_losses(run);
    REQUIRE(losses.size() == 2);
    for (double l : losses) CHECK(std::isfinite(l));
  }
}

// Below AVX-512 oneDNN 2.6 has no bf16 matmul (creating one throws): bf16 products then
// widen to f32 on the f32 GEMM route (backend/cpu/onednn.h). ONEDNN_MAX_CPU_ISA=AVX2 with
// MOETRAIN_ISA=avx2 stands in for an AVX2-only CPU: `moetrain info` says so and a bf16
// run trains, following the native bf16 run (the same exact products, summed in another
// order) within the bf16-vs-f32 bound. Before the fallback, both stopped with "could not
// create a primitive descriptor iterator".
TEST_CASE("cli: bf16 on a CPU without oneDNN bf16 kernels (AVX2) widens its products and trains", "[cli]") {
  Bf16Job job;
  const string avx2 = "ONEDNN_MAX_CPU_ISA=AVX2 MOETRAIN_ISA=avx2";
  const Result info = job.run(1, "info", avx2);
  INFO(info.output);
  CHECK(info.code == 0);
  CHECK(info.output.find("ISA avx2 (bf16 x bf16 -> f32 on a GPT-2 shape: none at this ISA: bf16 products widen to "
                         "f32") != string::npos);
  const int steps = 8;
  Result native = job.trained(1, job.gpt2("native", steps) + " --set train.dtype=bf16");
  Result widened = job.trained(1, job.gpt2("widened", steps) + " --set train.dtype=bf16", avx2);
  CHECK(widened.output.find("bf16 on this CPU: oneDNN has no bf16 matmul at ISA avx2") != string::npos);
  CHECK(native.output.find("oneDNN has no bf16 matmul") == string::npos);
  check_follows(metrics_losses(job.dir + "/widened"), metrics_losses(job.dir + "/native"), kBf16VsF32Gpt2);
}
