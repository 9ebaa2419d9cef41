// `moetrain generate (--checkpoint DIR | --init-from DIR | -c CONFIG) --prompt TEXT
//  [--max-new-tokens N] [--temperature T] [--top-k K] [--seed S] [--num-samples N]`
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
  };
  auto o = std::make_shared<Options>();
  cmd->add_option("--prompt", o->prompt, "text to continue (default: a newline)");
  cmd->add_option("--max-new-tokens", o->sampling.max_new_tokens, "tokens to generate")->check(CLI::PositiveNumber);
  cmd->add_option("--temperature", o->sampling.temperature, "0 = greedy (bit-reproducible)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--top-k", o->sampling.top_k, "sample among the k most likely tokens; 0 = all")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--seed", o->sampling.seed, "random seed of the sampler");
  cmd->add_option("--num-samples", o->num_samples, "independent samples (seeds seed, seed+1, ...)")
      ->check(CLI::PositiveNumber);
  commands.push_back({cmd, [source, o] {
    check_model_source(*source);
    Config config = resolve_config(*source);
    std::unique_ptr<Gpt2> model = build_model(config);
    auto tok = data::make_tokenizer(config.get_string("data.tokenizer"), config.get_string("data.tokenizer_dir"));
    std::vector<int32_t> prompt = tok->encode(o->prompt);
    if (prompt.empty() && tok->eot_token()) prompt.push_back(*tok->eot_token());
    SamplingOptions s = o->sampling;
    if (tok->eot_token()) s.stop_token = *tok->eot_token();
    for (int i = 0; i < o->num_samples; ++i) {
      if (o->num_samples > 1) fmt::print("--- sample {} ---\n", i + 1);
      s.seed = o->sampling.seed + static_cast<uint64_t>(i);
      fmt::print("{}{}\n", o->prompt, tok->decode(generate(*model, prompt, s)));
    }
    return 0;
  }});
}

}  // namespace moetrain::cli
