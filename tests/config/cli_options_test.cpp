// The config options on a CLI11 subcommand: -c, repeatable --set, --print-config.
#include <catch2/catch.hpp>

#include <CLI/CLI.hpp>

#include "config/cli_options.h"
#include "config/temp_dir.h"

using namespace moetrain;
using moetrain::testing::TempDir;

TEST_CASE("config cli: -c, repeated --set and --print-config reach the config", "[config][cli_options]") {
  TempDir dir;
  std::string path = dir.write("run.yaml", "model: {n_layer: 4}\n");
  CLI::App app;
  CLI::App* train = app.add_subcommand("train");
  std::vector<std::string> rest;
  train->add_option("rest", rest);
  std::shared_ptr<ConfigOptions> opts = add_config_options(train);
  app.parse("train -c " + path + " --set model.n_layer=6 extra --set=train.lr=1e-3 --print-config", false);
  CHECK(train->get_option("--set")->count() == 2);
  CHECK(opts->config_path == path);
  CHECK(opts->overrides == std::vector<std::string>{"model.n_layer=6", "train.lr=1e-3"});
  CHECK(rest == std::vector<std::string>{"extra"});  // --set takes one value
  CHECK(opts->print_config);
  Config c = load_from(*opts);
  CHECK(c.get_int("model.n_layer") == 6);
  CHECK(c.get_number("train.lr") == 1e-3);
  CHECK(c.where("train.lr") == "--set train.lr=1e-3");
}

TEST_CASE("config cli: -c is required unless the command says otherwise", "[config][cli_options]") {
  CLI::App app;
  std::shared_ptr<ConfigOptions> required = add_config_options(app.add_subcommand("train"));
  CHECK_THROWS_AS(app.parse("train --set model.n_layer=2", false), CLI::RequiredError);

  CLI::App app2;
  std::shared_ptr<ConfigOptions> opts = add_config_options(app2.add_subcommand("eval"), /*require_config=*/false);
  app2.parse("eval --set model.n_layer=2", false);
  CHECK_FALSE(opts->print_config);
  Config c = load_from(*opts);
  CHECK(c.get_int("model.n_layer") == 2);
  CHECK(c.get_int("model.n_head") == 12);
  CHECK_THROWS_WITH(load_from(ConfigOptions{"", {"model.nlayer=2"}, false}),
                    "--set model.nlayer=2: unknown key 'model.nlayer' (did you mean 'model.n_layer'?)");
}
