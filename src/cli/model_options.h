// The model-source options shared by generate and eval:
// -c CONFIG, --set, --init-from PATH, --checkpoint DIR (see train/model_source.h),
// --print-config.
#pragma once

#include <memory>

#include "train/model_source.h"

namespace CLI {
class App;
}

namespace moetrain::cli {

// --checkpoint's meaning, the same for generate, eval and export.
inline constexpr const char* kCheckpointHelp =
    "a model directory (<run>/model, an export) or a training checkpoint (<run>/checkpoints/step_N)";

struct ModelOptions {
  ModelSource source;
  bool print_config = false;  // --print-config: print the resolved config and exit
  std::string device = "cpu";  // --device (generate, eval): where the model runs
};
// with_device: also --device cpu|cuda (generate and eval; export only writes files).
std::shared_ptr<ModelOptions> add_model_source_options(CLI::App* cmd, bool with_device = false);
// Exactly one of -c, --init-from, --checkpoint must be given (-c with --init-from is fine).
void check_model_source(const ModelSource& source);
// Checks the source; with --print-config prints its resolved config and returns true
// (the command is done, exit 0).
bool print_config_if_asked(const ModelOptions& options);

}  // namespace moetrain::cli
