// `moetrain generate (--checkpoint DIR | --init-from DIR | -c CONFIG) --prompt TEXT
//  [--max-new-tokens N] [--temperature T] [--top-k K] [--seed S] [--num-samples N] [--stats]`
// --stats prints, on stderr, the decoding-cache memory as the sequence grows:
// constant for KDA layers (a state per head), linear for MLA (latent) and
// attention (KV) layers.
#include <cstdio>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "cli/commands.h"
#include "cli/model_options.h"
#include "data/tokenizer.h"
#include "train/sampling.h"

namespace moetrain::cli {

void add_generate_command(CLI::App& app, Commands& commands) {
  CLI::App* cmd = app.add_subcommand("generate", "Sample text from a model (KV cache)");
  auto source = add_model_source_options(cmd);
  struct Options {
    std::string prompt = "\n";
    SamplingOptions sampling;
    int num_samples = 1;
    bool stats = false;
  };
  auto o = std::make_shared<Options>();
  cmd->add_option("--prompt", o->prompt, "text to continue (default: a newline)");
  cmd->add_option("--max-new-tokens", o->sampling.max_new_tokens, "tokens to generate")->check(positive());
  cmd->add_option("--temperature", o->sampling.temperature, "0 = greedy (bit-reproducible)")
      ->check(non_negative());
  cmd->add_option("--top-k", o->sampling.top_k, "sample among the k most likely tokens; 0 = all")
      ->check(non_negative());
  cmd->add_option("--seed", o->sampling.seed, "random seed of the sampler");
  cmd->add_option("--num-samples", o->num_samples, "independent samples (seeds seed, seed+1, ...)")
      ->check(positive());
  cmd->add_flag("--stats", o->stats, "print the decoding-cache memory per generated length (stderr)");
  commands.push_back({cmd, [source, o] {
    check_model_source(*source);
    Config config = resolve_config(*source);
    std::unique_ptr<LanguageModel> model = build_model(config);
    auto tok = data::make_tokenizer(config.get_string("data.tokenizer"), config.get_string("data.tokenizer_dir"));
    std::vector<int32_t> prompt = tok->encode(o->prompt);
    if (prompt.empty() && tok->eot_token()) prompt.push_back(*tok->eot_token());
    SamplingOptions s = o->sampling;
    if (tok->eot_token()) s.stop_token = *tok->eot_token();
    for (int i = 0; i < o->num_samples; ++i) {
      if (o->num_samples > 1) fmt::print("--- sample {} ---\n", i + 1);
      s.seed = o->sampling.seed + static_cast<uint64_t>(i);
      GenerateStats stats;
      fmt::print("{}{}\n", o->prompt, tok->decode(generate(*model, prompt, s, o->stats ? &stats : nullptr)));
      if (o->stats) {
        std::fflush(stdout);
        fmt::print(stderr, "decode cache ({}): tokens bytes\n", model->arch());
        size_t n = stats.cache_bytes.size();
        for (size_t j = 0; j < n; ++j)
          if (j + 1 == n || ((j + 1) & j) == 0)  // powers of two and the last
            fmt::print(stderr, "  {} {}\n", stats.cache_bytes[j].first, stats.cache_bytes[j].second);
      }
    }
    return 0;
  }});
}

}  // namespace moetrain::cli
