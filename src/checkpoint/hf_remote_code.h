// The transformers remote code of the hybrid (python/moetrain_hf/: configuration_moetrain_hybrid.py,
// modeling_moetrain_hybrid.py), compiled into the binary (python/moetrain_hf/embed.cmake) so that
// every moetrain_hybrid export carries it beside the weights, named by config.json's auto_map
// (docs/export.md#running-a-moetrain_hybrid-export-in-transformers).
#pragma once

#include <string>
#include <vector>

namespace moetrain {

struct HfRemoteCodeFile {
  const char* name;  // file name in the export directory
  const char* text;
};

const std::vector<HfRemoteCodeFile>& hf_remote_code_files();

}  // namespace moetrain
