// docs/configs.md, generated from the schema (config/schema.h): every key with its
// type, default, allowed values and meaning, section by section. `moetrain schema`
// prints it; a test fails when the file in docs/ differs from what this build
// generates, so the reference cannot drift from what the loader validates.
#pragma once

#include <string>

namespace moetrain {

// The whole Markdown text of docs/configs.md.
std::string config_reference_markdown();

}  // namespace moetrain
