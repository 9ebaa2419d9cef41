// `moetrain eval (-c CONFIG | --init-from DIR | --checkpoint DIR) --data SHARD.bin
//  [--seq-len T] [--batch-size B] [--batches N] [--json]`: mean next-token
// cross-entropy over consecutive non-overlapping windows of T tokens from the
// start of the shard(s).
#include <cmath>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "cli/commands.h"
#include "cli/model_options.h"
#include "core/error.h"
#include "data/loader.h"
#include "train/eval.h"

namespace moetrain::cli {

void add_eval_command(CLI::App& app, Commands& commands) {
  CLI::App* cmd = app.add_subcommand("eval", "Mean next-token loss of a model on token shards");
  auto source = add_model_source_options(cmd, true);
  struct Options {
    std::string data;
    int64_t seq_len = 0, batch_size = 1, batches = 0;
    bool json = false;
  };
  auto o = std::make_shared<Options>();
  cmd->add_option("--data", o->data, "token shard(s): a file or a glob like data/x/val_*.bin; required");
  cmd->add_option("--seq-len", o->seq_len, "window length T; 0: train.seq_len of the config")
      ->check(positive());
  cmd->add_option("--batch-size", o->batch_size, "windows per forward pass")->check(positive());
  cmd->add_option("--batches", o->batches, "batches to average; 0: all complete batches")
      ->check(non_negative());
  cmd->add_flag("--json", o->json, "print {\"loss\": ..., \"tokens\": ...} instead of a line");
  commands.push_back({cmd, [source, o] {
    if (print_config_if_asked(*source)) return 0;
    MT_CHECK(!o->data.empty(), "moetrain eval: --data is required (the token shards to score); run 'moetrain eval "
             "--help' for the options");
    LoadedModel loaded = load_model(source->source);
    const Config& config = loaded.config;
    std::unique_ptr<LanguageModel>& model = loaded.model;
    place_model(*model, source->device);
    data::DataLoaderOptions lo;
    lo.batch_size = o->batch_size;
    lo.seq_len = o->seq_len > 0 ? o->seq_len : config.get_int("train.seq_len");
    lo.vocab_size = model->vocab_size();
    lo.order = data::LoaderOrder::sequential;
    data::DataLoader loader(o->data, lo);
    int64_t per_epoch = loader.num_windows() / lo.batch_size;
    int64_t batches = o->batches > 0 ? std::min(o->batches, per_epoch) : per_epoch;
    double loss = evaluate(*model, loader, batches);
    int64_t tokens = batches * lo.batch_size * lo.seq_len;
    if (!std::isfinite(loss))  // never a silent NaN: the weights load (they are finite) but overflow in use
      throw NumericalError(fmt::format("eval: the mean loss over {} tokens of {} is {}: the model's outputs are not "
                                       "finite (weights too large to compute with in {}?)", tokens, o->data, loss,
                                       model->dtype()));
    if (o->json) fmt::print("{{\"loss\": {:.9g}, \"tokens\": {}, \"seq_len\": {}}}\n", loss, tokens, lo.seq_len);
    else fmt::print("loss {:.9g}\n", loss);
    return 0;
  }});
}

}  // namespace moetrain::cli
