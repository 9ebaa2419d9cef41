// The model-source options shared by generate and eval:
// -c CONFIG, --set, --init-from PATH, --checkpoint DIR (see train/model_source.h).
#pragma once

#include <memory>

#include "train/model_source.h"

namespace CLI {
class App;
}

namespace moetrain::cli {

std::shared_ptr<ModelSource> add_model_source_options(CLI::App* cmd);
// Exactly one of -c, --init-from, --checkpoint must be given (-c with --init-from is fine).
void check_model_source(const ModelSource& source);

}  // namespace moetrain::cli
