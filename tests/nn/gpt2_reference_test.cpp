// PyTorch parity: tests/reference/gpt2_reference.py builds a small GPT-2 with
// random weights in plain PyTorch (Debian python3-torch), writes it as a Hugging
// Face model directory and writes its logits, loss, every gradient and the
// losses and weights of 10 AdamW steps. moetrain imports the directory and must
// reproduce all of it.
#include <catch2/catch.hpp>

#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "checkpoint/export.h"
#include "checkpoint/safetensors.h"
#include "moetrain.h"
#include "nn/gpt2_hf.h"
#include "optim/adamw.h"

using namespace moetrain;

namespace {

std::string run_reference(const std::string& dtype) {
  std::string out = std::string(MOETRAIN_BINARY_DIR) + "/reference/gpt2_" + dtype;
  std::filesystem::remove_all(out);
  std::string cmd = std::string("/usr/bin/python3 ") + MOETRAIN_SOURCE_DIR + "/tests/reference/gpt2_reference.py " +
                    out + " --dtype " + dtype;
  REQUIRE(std::system(cmd.c_str()) == 0);
  return out;
}

bool is_conv1d(const std::string& name) {
  return name.find("c_attn.weight") != std::string::npos || name.find("c_proj.weight") != std::string::npos ||
         name.find("c_fc.weight") != std::string::npos;
}

// max |a - b| / max |b|: the error relative to the tensor's scale.
double relative_error(const Tensor& a, const Tensor& b) {
  std::vector<double> va = a.to_vector(), vb = b.to_vector();
  REQUIRE(va.size() == vb.size());
  double diff = 0, scale = 0;
  for (size_t i = 0; i < va.size(); ++i) {
    diff = std::max(diff, std::abs(va[i] - vb[i]));
    scale = std::max(scale, std::abs(vb[i]));
  }
  return diff / std::max(scale, 1e-30);
}

void check_parity(const std::string& dtype_name, DType dtype, double tol) {
  std::string dir = run_reference(dtype_name);
  Gpt2Config cfg;
  cfg.dtype = dtype;
  cfg = read_gpt2_hf_config(dir + "/model/config.json", cfg);
  Gpt2 model(cfg, 0);
  load_hf_weights(model, gpt2_hf_weights_path(dir + "/model"));
  SafetensorsFile expected = SafetensorsFile::open(dir + "/expected.safetensors");

  Tensor ids = expected.read("ids"), targets = expected.read("targets");
  Tensor logits = model.forward(ids, false);
  CHECK(relative_error(logits, expected.read("logits")) < tol);
  Tensor loss = cross_entropy(logits, targets);
  CHECK(std::abs(loss.item<double>() - expected.read("loss").item<double>()) <
        tol * std::abs(expected.read("loss").item<double>()));
  loss.backward();
  for (NamedParameter& p : model.parameters()) {
    Tensor g = expected.read("grad." + p.name);
    if (is_conv1d(p.name)) g = transpose(g, 0, 1);
    INFO("gradient of " << p.name);
    CHECK(relative_error(p.tensor.grad(), g) < tol);
  }

  AdamW opt(model.parameters(), {0.9, 0.95, 1e-8, 0.1});
  Tensor step_ids = expected.read("step_ids"), step_targets = expected.read("step_targets");
  std::vector<double> losses = expected.read("step_losses").to_vector();
  for (int64_t s = 0; s < static_cast<int64_t>(losses.size()); ++s) {
    opt.zero_grad();
    Tensor l = model.loss(reshape(slice(step_ids, 0, s, s + 1), {step_ids.size(1), step_ids.size(2)}),
                          reshape(slice(step_targets, 0, s, s + 1), {step_ids.size(1), step_ids.size(2)}));
    l.backward();
    clip_grad_norm(model.parameters(), 1.0);
    opt.step(1e-3);
    INFO("step " << s);
    CHECK(std::abs(l.item<double>() - losses[static_cast<size_t>(s)]) < tol * std::abs(losses[static_cast<size_t>(s)]));
  }
  for (NamedParameter& p : model.parameters()) {
    Tensor w = expected.read("final." + p.name), ours = p.tensor;
    if (is_conv1d(p.name)) w = transpose(w, 0, 1);
    if (dtype == DType::f32 && p.name.find("attn.c_attn.bias") != std::string::npos) {
      // The key bias has an exactly zero gradient (q·b_k shifts a softmax row by a
      // constant); in f32 both sides get rounding noise of ~1e-9 there, which Adam
      // normalises into lr-sized steps of random sign. Compare the q and v parts.
      int64_t D = cfg.d_model;
      w = concat({slice(w, 0, 0, D), slice(w, 0, 2 * D, 3 * D)}, 0);
      ours = concat({slice(ours, 0, 0, D), slice(ours, 0, 2 * D, 3 * D)}, 0);
    }
    // Adam turns tiny gradients into steps of about lr whatever their size, so
    // rounding differences in small gradients reach the weights amplified: f32
    // weights after 10 steps get 5x the tolerance of the losses.
    INFO("weight after training: " << p.name);
    CHECK(relative_error(ours, w) < (dtype == DType::f32 ? 5 * tol : tol));
  }
}

}  // namespace

TEST_CASE("gpt2 reference: f64 logits, loss, gradients and 10 AdamW steps equal PyTorch", "[nn][gpt2][reference]") {
  check_parity("f64", DType::f64, 1e-10);
}

TEST_CASE("gpt2 reference: f32 logits, loss, gradients and 10 AdamW steps equal PyTorch", "[nn][gpt2][reference]") {
  check_parity("f32", DType::f32, 1e-5);
}

TEST_CASE("gpt2 reference: moetrain eval --init-from equals the PyTorch loss over the shard's windows",
          "[nn][gpt2][reference]") {
  std::string dir = run_reference("f64");
  std::string out = dir + "/eval_out.json";
  std::string cmd = std::string(MOETRAIN_BINARY_DIR) + "/moetrain eval --init-from " + dir +
                    "/model --set train.dtype=f64 --data " + dir + "/eval.bin --seq-len 16 --batch-size 2 --json > " +
                    out;
  REQUIRE(std::system(cmd.c_str()) == 0);
  std::ifstream in(out);
  std::string json((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  double loss = std::stod(json.substr(json.find(':') + 1));
  double expected = SafetensorsFile::open(dir + "/expected.safetensors").read("eval_loss").item<double>();
  CHECK(loss == Approx(expected).epsilon(1e-9));
  CHECK(json.find("\"tokens\": 64") != std::string::npos);
}
