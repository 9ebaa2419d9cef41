#include "cli/commands.h"

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "backend/cpu/parallel.h"
#include "config/cli_options.h"
#include "core/error.h"
#include "core/signals.h"

namespace moetrain::cli {

namespace {

// The apps on the command line: moetrain, then each subcommand parsed so far.
std::vector<const CLI::App*> parsed_chain(const CLI::App& app) {
  std::vector<const CLI::App*> chain = {&app};
  for (;;) {
    const std::vector<CLI::App*> parsed = chain.back()->get_subcommands();
    if (parsed.empty()) return chain;
    chain.push_back(parsed.back());
  }
}

// A command-line mistake as one line with exit code 2 (moetrain::Error), instead of
// CLI11's own codes (105, 106, 109, ...) and multi-line output.
[[noreturn]] void throw_usage_error(const CLI::App& app, const CLI::ParseError& e) {
  std::string what = e.what();
  while (!what.empty() && (what.back() == '\n' || what.back() == ' ')) what.pop_back();
  for (char& c : what)
    if (c == '\n') c = ' ';
  const std::vector<const CLI::App*> chain = parsed_chain(app);
  // Arguments nobody took: the likelier mistake than a required option reported first.
  const std::vector<std::string> extra = app.remaining(true);
  const bool extras = e.get_exit_code() == static_cast<int>(CLI::ExitCodes::ExtrasError);
  const bool no_command = chain.size() == 1 && (extras || e.get_exit_code() == static_cast<int>(CLI::ExitCodes::RequiredError));
  if (no_command) {
    // `moetrain`, `moetrain frobnicate`: name the commands.
    if (!extra.empty() && !extra.front().empty() && extra.front()[0] != '-')
      what = fmt::format("unknown command '{}'", extra.front());
    else if (!extra.empty() && !extras)
      what = fmt::format("unexpected argument{} {} (and: {})", extra.size() > 1 ? "s" : "", fmt::join(extra, " "), what);
    std::vector<std::string> names;
    for (const CLI::App* sub : app.get_subcommands({})) names.push_back(sub->get_name());
    throw Error(fmt::format("moetrain: {} (commands: {}); run 'moetrain --help' for the commands", what,
                            fmt::join(names, ", ")));
  }
  if (!extra.empty() && !extras)
    what = fmt::format("unexpected argument{} {} (and: {})", extra.size() > 1 ? "s" : "", fmt::join(extra, " "), what);
  // "--threads: ..." belongs to the app that defines --threads, whose --help lists it.
  size_t owner = chain.size() - 1;
  if (!what.empty() && what[0] == '-') {
    const std::string name = what.substr(0, what.find_first_of(": "));
    size_t at = owner;
    while (at > 0 && !chain[at]->get_option_no_throw(name)) --at;
    if (chain[at]->get_option_no_throw(name)) owner = at;
  }
  std::string path = "moetrain";
  for (size_t i = 1; i <= owner; ++i) path += " " + chain[i]->get_name();
  throw Error(fmt::format("{}: {}; run '{} --help' for the options", path, what, path));
}

}  // namespace

CLI::Validator at_least(double min) {
  return CLI::Validator(
      [min](std::string& value) -> std::string {
        double v = 0;
        if (!CLI::detail::lexical_cast(value, v)) return fmt::format("expected a number, got '{}'", value);
        if (v < min) return fmt::format("must be >= {}, got {}", min, value);
        return {};
      },
      fmt::format(">= {}", min));
}
CLI::Validator positive() { return at_least(1); }
CLI::Validator non_negative() { return at_least(0); }

int run(int argc, char** argv) {
  CLI::App app{"moetrain: train GPT-2 and Kimi-K3-style hybrid MoE models"};
  app.set_version_flag("--version", std::string("moetrain ") + MOETRAIN_VERSION);
  app.require_subcommand(1);
  // --help shows every option's default (subcommands inherit this when made).
  app.option_defaults()->always_capture_default();
  int threads = 0;
  const char* threads_help = "CPU threads for kernels and BLAS; 0: cores / local ranks (at most 4 per core)";
  app.add_option("--threads", threads, threads_help)->check(non_negative());

  Commands commands;
  add_info_command(app, commands);
  add_prepare_command(app, commands);
  add_train_command(app, commands);
  add_generate_command(app, commands);
  add_eval_command(app, commands);
  add_ledger_command(app, commands);
  add_op_command(app, commands);
  add_export_command(app, commands);
  add_schema_command(app, commands);
  // The common options work after the subcommand too: `moetrain train --threads 2 -c ...`.
  for (CLI::App* sub : app.get_subcommands({}))
    sub->add_option("--threads", threads, threads_help)->check(non_negative());
  // "--seed -1", "--temperature nan": refused, not wrapped or sampled with.
  check_numeric_options(app);

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help, --help-all, --version: printed, exit 0
    throw_usage_error(app, e);
  }
  // Only training has something to save when a stop signal comes; the other
  // commands end as any program would (a signal noted while parsing included).
  if (!app.got_subcommand("train")) signals::restore_default_actions();
  cpu::init_threads();
  if (threads > 0) cpu::set_num_threads(cpu::capped_thread_count(threads, "--threads"));
  for (const Command& c : commands)
    if (c.app->parsed()) return c.run();
  return 0;
}

}  // namespace moetrain::cli
