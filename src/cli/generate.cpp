// `moetrain generate (--checkpoint DIR | --init-from DIR | -c CONFIG) [--device cpu|cuda] --prompt TEXT
//  [--max-new-tokens N] [--temperature T] [--top-k K] [--seed S] [--num-samples N] [--stats]`
// --max-new-tokens beyond what the model's context holds after the prompt is an error
// (exit 2) naming the largest that fits; the default 128 is lowered to it.
// --stats prints, on stderr, the decoding-cache memory as the sequence grows:
// constant for KDA layers (a state per head), linear for MLA (latent) and
// attention (KV) layers.
#include <unistd.h>

#include <algorithm>
#include <cstdio>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "cli/commands.h"
#include "cli/model_options.h"
#include "core/error.h"
#include "data/tokenizer.h"
#include "data/utf8.h"
#include "nn/model_family.h"
#include "train/sampling.h"

namespace moetrain::cli {

namespace {

// No model here has a sliding window: generation ends when the context is full
// (train/sampling.h). Asking for more than fits is an error up front rather than a
// silently shorter text; the default is lowered to what fits, with a note.
int64_t new_tokens_in_context(const LanguageModel& model, int64_t prompt_tokens, int64_t asked, bool explicit_flag) {
  const int64_t n_ctx = model.max_positions();
  MT_CHECK(prompt_tokens > 0, "generate: the prompt is empty; give at least one token (the default --prompt is a "
           "newline)");
  const int64_t room = max_new_tokens_in_context(n_ctx, prompt_tokens);
  MT_CHECK(room > 0, "generate: the prompt is {} tokens but the model's context is {} positions (model.n_ctx); "
           "shorten --prompt to at most {} tokens", prompt_tokens, n_ctx, n_ctx - 1);
  if (asked <= room) return asked;
  MT_CHECK(!explicit_flag, "generate: --max-new-tokens {} does not fit: after the {}-token prompt the model's context "
           "of {} positions (model.n_ctx) holds at most {} new tokens (the last predicted from the full context; no "
           "sliding window); pass --max-new-tokens {} or less, or a shorter --prompt",
           asked, prompt_tokens, n_ctx, room, room);
  spdlog::info("generate: {} new tokens (the most the model's {}-position context holds after the {}-token prompt; "
               "the default is {})", room, n_ctx, prompt_tokens, asked);
  return room;
}

}  // namespace

void add_generate_command(CLI::App& app, Commands& commands) {
  CLI::App* cmd = app.add_subcommand("generate", "Sample text from a model (KV cache)");
  auto source = add_model_source_options(cmd, true);
  struct Options {
    std::string prompt = "\n";
    SamplingOptions sampling;
    int num_samples = 1;
    bool stats = false, raw = false;
  };
  auto o = std::make_shared<Options>();
  o->sampling.top_k = 40;  // as train.sample_top_k: the samples a run prints and generate's agree
  cmd->add_option("--prompt", o->prompt, "text to continue")->default_str("a newline");
  CLI::Option* max_new = cmd->add_option("--max-new-tokens", o->sampling.max_new_tokens,
                                         "tokens to generate (the default is lowered to what the context holds)")
                             ->check(positive());
  cmd->add_option("--temperature", o->sampling.temperature, "0 = greedy (bit-reproducible)")
      ->check(non_negative());
  cmd->add_option("--top-k", o->sampling.top_k, "sample among the k most likely tokens; 0 = all")
      ->check(non_negative());
  cmd->add_option("--seed", o->sampling.seed, "random seed of the sampler");
  cmd->add_option("--num-samples", o->num_samples, "independent samples (seeds seed, seed+1, ...)")
      ->check(positive());
  cmd->add_flag("--stats", o->stats, "print the decoding-cache memory per generated length (stderr)");
  cmd->add_flag("--raw", o->raw, "write the decoded bytes as they are; by default a terminal gets ill-formed UTF-8 "
                "as U+FFFD and control bytes other than newline and tab as \\xNN");
  commands.push_back({cmd, [source, o, max_new] {
    if (print_config_if_asked(*source)) return 0;
    LoadedModel loaded = load_model(source->source);
    const Config& config = loaded.config;
    std::unique_ptr<LanguageModel>& model = loaded.model;
    place_model(*model, source->device);
    auto tok = data::make_tokenizer(config.get_string("data.tokenizer"), config.get_string("data.tokenizer_dir"));
    std::vector<int32_t> prompt = tok->encode(o->prompt);
    if (prompt.empty() && tok->eot_token()) prompt.push_back(*tok->eot_token());
    SamplingOptions s = o->sampling;
    if (tok->eot_token()) s.stop_token = *tok->eot_token();
    s.max_new_tokens = new_tokens_in_context(*model, static_cast<int64_t>(prompt.size()), s.max_new_tokens,
                                             max_new->count() > 0);
    // A moetrain-trained GPT-2 has learned positions: those past train.seq_len never
    // received a gradient, and text generated there degrades.
    const int64_t trained = config.get_int("train.seq_len");
    const int64_t total = static_cast<int64_t>(prompt.size()) + s.max_new_tokens;
    if (!source->source.checkpoint.empty() && model_family(config).capabilities.learned_positions &&
        total > trained)
      spdlog::warn("generate: {} positions (prompt + new tokens), but the model was trained on sequences of "
                   "train.seq_len = {}: its learned positions past {} were never trained and text there degrades; "
                   "pass --max-new-tokens {} or less", total, trained, trained,
                   std::max<int64_t>(1, trained - static_cast<int64_t>(prompt.size())));
    const bool terminal = isatty(STDOUT_FILENO) != 0;
    for (int i = 0; i < o->num_samples; ++i) {
      if (o->num_samples > 1) fmt::print("--- sample {} ---\n", i + 1);
      s.seed = o->sampling.seed + static_cast<uint64_t>(i);
      GenerateStats stats;
      const std::string text = o->prompt + tok->decode(generate(*model, prompt, s, o->stats ? &stats : nullptr));
      fmt::print("{}\n", o->raw || !terminal ? text : data::printable_text(text));
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
