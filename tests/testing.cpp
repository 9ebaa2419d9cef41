#include "testing.h"

#include <catch2/catch.hpp>

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>

#include "moetrain.h"

namespace moetrain::testing {

namespace {

std::vector<std::vector<double>> values(const Tensors& outs, const std::vector<std::vector<double>>& w) {
  std::vector<std::vector<double>> v(outs.size());
  for (size_t k = 0; k < outs.size(); ++k)
    if (!w[k].empty()) v[k] = outs[k].to_vector();
  return v;
}

// <w, up - down>: differences first, so outputs the perturbation does not
// touch cancel exactly instead of adding rounding noise.
double weighted_difference(const std::vector<std::vector<double>>& up, const std::vector<std::vector<double>>& down,
                           const std::vector<std::vector<double>>& w) {
  double total = 0;
  for (size_t k = 0; k < w.size(); ++k)
    for (size_t i = 0; i < w[k].size(); ++i) total += w[k][i] * (up[k][i] - down[k][i]);
  return total;
}

}  // namespace

bool gpu_available() {
  static const bool available = [] {
    bool yes = cuda::device_count() > 0;
    if (!yes)
      fmt::print(stderr, "[cuda] tests skipped: {}\n",
                 cuda::built_with_cuda() ? "no CUDA device is visible" : "this build has no CUDA backend");
    return yes;
  }();
  return available;
}

GradCheckResult check_gradients(const std::function<Tensors(const Tensors&)>& fn, const Tensors& inputs,
                                GradCheckOptions opts) {
  // Fresh leaves (copies), so perturbations never touch the caller's tensors.
  Tensors leaves;
  std::vector<bool> check(inputs.size(), false);
  for (size_t i = 0; i < inputs.size(); ++i) {
    Tensor c = inputs[i].defined() ? inputs[i].detach().clone() : Tensor();
    bool want = c.defined() && is_floating(c.dtype()) && (opts.check.empty() || opts.check[i]);
    if (want) {
      REQUIRE(c.dtype() == DType::f64);
      c.set_requires_grad(true);
    }
    check[i] = want;
    leaves.push_back(c);
  }

  Tensors outs = fn(leaves);
  std::vector<std::vector<double>> w(outs.size());
  Tensors roots, grads;
  for (size_t k = 0; k < outs.size(); ++k) {
    if (!outs[k].defined() || !is_floating(outs[k].dtype()) || !outs[k].requires_grad()) continue;
    Tensor wk = randn(outs[k].shape(), outs[k].dtype(), opts.seed + k);
    w[k] = wk.to_vector();
    roots.push_back(outs[k]);
    grads.push_back(wk);
  }
  REQUIRE(!roots.empty());
  autograd::backward(roots, grads);

  GradCheckResult result;
  for (size_t i = 0; i < leaves.size(); ++i) {
    if (!check[i]) continue;
    Tensor x = leaves[i];
    Tensor analytic = x.grad();
    std::vector<double> a = analytic.defined() ? analytic.to_vector() : std::vector<double>(x.numel(), 0.0);
    double* p = x.data<double>();
    NoGradGuard no_grad;
    for (int64_t e = 0; e < x.numel(); ++e) {
      double orig = p[e];
      p[e] = orig + opts.eps;
      auto up = values(fn(leaves), w);
      p[e] = orig - opts.eps;
      auto down = values(fn(leaves), w);
      p[e] = orig;
      double numeric = weighted_difference(up, down, w) / (2 * opts.eps);
      double an = a[static_cast<size_t>(e)];
      double rel = std::abs(an - numeric) / std::max({std::abs(an), std::abs(numeric), opts.floor});
      if (rel > result.max_rel_error || std::isnan(rel)) {
        result.max_rel_error = std::isnan(rel) ? INFINITY : rel;
        result.worst = fmt::format("input {} {} element {}: analytic {:.12g} numeric {:.12g}", i, x.shape(), e, an,
                                   numeric);
      }
    }
  }
  INFO("worst: " << result.worst);
  CHECK(result.max_rel_error < opts.tolerance);
  return result;
}

GradCheckResult check_gradients(const std::function<Tensor(const Tensors&)>& fn, const Tensors& inputs,
                                GradCheckOptions opts) {
  return check_gradients([&](const Tensors& in) { return Tensors{fn(in)}; }, inputs, opts);
}

GradCheckResult check_parameter_gradients(ParameterList& params, const std::function<Tensor()>& loss) {
  for (NamedParameter& p : params) p.tensor.zero_grad();
  loss().backward();
  GradCheckResult r;
  NoGradGuard no_grad;
  for (NamedParameter& p : params) {
    REQUIRE(p.tensor.grad().defined());
    std::vector<double> g = p.tensor.grad().to_vector();
    double* data = p.tensor.data<double>();
    for (int64_t e : {int64_t{0}, p.tensor.numel() / 2, p.tensor.numel() - 1}) {
      const double eps = 1e-6, orig = data[e];
      data[e] = orig + eps;
      const double up = loss().item<double>();
      data[e] = orig - eps;
      const double down = loss().item<double>();
      data[e] = orig;
      const double numeric = (up - down) / (2 * eps), an = g[static_cast<size_t>(e)];
      const double rel = std::abs(an - numeric) / std::max({std::abs(an), std::abs(numeric), 1e-3});
      if (rel > r.max_rel_error) {
        r.max_rel_error = rel;
        r.worst = fmt::format("{} element {}: analytic {} numeric {}", p.name, e, an, numeric);
      }
    }
  }
  return r;
}

double rel_error(const Tensor& a, const Tensor& b) {
  std::vector<double> x = a.to_vector(), y = b.to_vector();
  REQUIRE(x.size() == y.size());
  double diff = 0, scale = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    if (std::isnan(x[i]) || std::isnan(y[i])) return INFINITY;
    diff = std::max(diff, std::abs(x[i] - y[i]));
    scale = std::max(scale, std::abs(y[i]));
  }
  return scale > 0 ? diff / scale : diff;
}

double max_abs_diff(const Tensor& a, const Tensor& b) {
  REQUIRE(a.shape() == b.shape());
  std::vector<double> va = a.to_vector(), vb = b.to_vector();
  double m = 0;
  for (size_t i = 0; i < va.size(); ++i) {
    double d = std::abs(va[i] - vb[i]);
    if (std::isnan(d)) return INFINITY;
    m = std::max(m, d);
  }
  return m;
}

bool bitwise_equal(const Tensor& a, const Tensor& b) {
  if (!(a.shape() == b.shape()) || a.dtype() != b.dtype()) return false;
  if (a.nbytes() == 0) return true;
  Tensor ha = a.to(kCpu), hb = b.to(kCpu);
  return std::memcmp(ha.raw_data(), hb.raw_data(), static_cast<size_t>(ha.nbytes())) == 0;
}

std::vector<cpu::VectorIsa> runnable_isas() {
  std::vector<cpu::VectorIsa> isas{cpu::VectorIsa::generic};
  if (cpu::cpu_vector_isa() >= cpu::VectorIsa::avx2) isas.push_back(cpu::VectorIsa::avx2);
  if (cpu::cpu_vector_isa() >= cpu::VectorIsa::avx512) isas.push_back(cpu::VectorIsa::avx512);
  return isas;
}

void check_vector_copies(const std::function<std::vector<Tensor>(DType)>& run, double rel_tol) {
  const std::vector<Tensor> ref = run(DType::f64);
  std::vector<std::vector<Tensor>> copies;
  for (cpu::VectorIsa isa : runnable_isas()) {
    cpu::cap_vector_isa_for_testing(isa);
    copies.push_back(run(DType::f32));
    INFO("copy " << cpu::vector_isa_name(isa));
    for (size_t i = 0; i < ref.size(); ++i) {
      INFO("tensor " << i);
      CHECK(rel_error(copies.back()[i].to(DType::f64), ref[i]) < rel_tol);
    }
  }
  cpu::cap_vector_isa_for_testing(std::nullopt);
  if (copies.size() == 3)
    for (size_t i = 0; i < ref.size(); ++i) {
      INFO("AVX2 vs AVX-512 copy, tensor " << i);
      CHECK(bitwise_equal(copies[2][i], copies[1][i]));
    }
}

TempDir::TempDir() {
  const char* base = std::getenv("TMPDIR");
  std::string tmpl = std::string(base && *base ? base : "/tmp") + "/moetrain_test_XXXXXX";
  REQUIRE(::mkdtemp(tmpl.data()) != nullptr);
  path_ = tmpl;
}

TempDir::~TempDir() {
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
}

std::string TempDir::write(std::string_view name, std::string_view bytes) const {
  std::filesystem::path p = *this / name;
  std::filesystem::create_directories(p.parent_path());
  write_bytes(p.string(), bytes);
  return p.string();
}

std::vector<std::string> TempDir::listing() const {
  std::vector<std::string> names;
  for (const auto& e : std::filesystem::directory_iterator(path_)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  REQUIRE(in.good());
  std::ostringstream ss;
  ss << in.rdbuf();
  return std::move(ss).str();
}

std::string metrics_history(const std::string& run_dir) {
  std::stringstream in(read_bytes(run_dir + "/metrics.jsonl"));
  std::ostringstream out;
  static const std::regex run_id(R"(,"run":"[^"]*")");  // which run wrote a record: not the computation
  for (std::string line; std::getline(in, line);) {
    line = std::regex_replace(line, run_id, "");
    auto cut = line.find(",\"tok_per_s\"");
    out << (cut == std::string::npos ? line : line.substr(0, cut)) << "\n";
  }
  return std::move(out).str();
}

void prepare_byte_shards(const std::string& dir) {
  const CommandOutput r = run_moetrain("prepare " + std::string(MOETRAIN_SOURCE_DIR) +
                                       "/data/tinyshakespeare.txt --out " + dir + "/data --tokenizer byte "
                                       "--val-tokens 8192");
  INFO(r.output);
  REQUIRE(r.code == 0);
}

const std::vector<std::string>& one_process_configs() {
  static const std::vector<std::string> configs{"gpt2-shakespeare", "gpt2-small",         "k3-tiny",
                                                "k3-small",         "k3-shakespeare",     "k3-shakespeare-bpe",
                                                "k3-topology-mini"};
  return configs;
}

std::string short_config_run_args(const std::string& config, const std::string& dir, const std::string& run_dir) {
  return "train -c " + std::string(MOETRAIN_SOURCE_DIR) + "/configs/" + config + ".yaml --set data.train=" + dir +
         "/data/train_*.bin --set data.val= --set data.tokenizer=byte --set train.max_steps=2 "
         "--set train.warmup_steps=1 --set train.batch_size=1 --set train.seq_len=16 --set train.eval_every=0 "
         "--set train.sample_every=0 --set train.threads=1 --set train.ep=1 --set run.dir=" + run_dir;
}

std::string tiny_gpt2_train_args(const std::string& dir, const std::string& run_dir, int steps) {
  return "train -c " + std::string(MOETRAIN_SOURCE_DIR) + "/configs/gpt2-shakespeare.yaml --set model.vocab_size=256 "
         "--set model.n_layer=2 --set model.n_head=2 --set model.d_model=32 --set model.n_ctx=64 "
         "--set data.tokenizer=byte --set data.train=" + dir + "/data/train_*.bin --set data.val= "
         "--set train.batch_size=4 --set train.seq_len=32 --set train.max_steps=" + std::to_string(steps) +
         " --set train.warmup_steps=2 --set train.eval_every=0 --set train.sample_every=0 --set train.threads=1 "
         "--set train.log_every=1000 --set run.dir=" + run_dir;
}

std::vector<double> metrics_losses(const std::string& run_dir) {
  std::stringstream in(read_bytes(run_dir + "/metrics.jsonl"));
  std::vector<double> out;
  for (std::string line; std::getline(in, line);)
    if (auto at = line.find("\"loss\":"); at != std::string::npos) out.push_back(std::stod(line.substr(at + 7)));
  return out;
}

void write_bytes(const std::string& path, std::string_view bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  REQUIRE(out.good());
}

CommandOutput capture_command(const std::string& command, bool merge_stderr) {
  std::string cmd = command + (merge_stderr ? " 2>&1" : " 2>/dev/null");
  std::FILE* p = ::popen(cmd.c_str(), "r");
  REQUIRE(p != nullptr);
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  int status = ::pclose(p);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

CommandOutput run_moetrain(const std::string& args, bool merge_stderr) {
  return capture_command(std::string(MOETRAIN_BINARY_DIR) + "/moetrain " + args, merge_stderr);
}

int run_command(const std::string& command) {
  int status = std::system(command.c_str());
  return status != -1 && WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

std::string shell_quote(std::string_view s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

}  // namespace moetrain::testing
