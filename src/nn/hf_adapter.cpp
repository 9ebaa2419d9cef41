// config.json's model_type -> the family that reads it (hf_adapter.h).
#include "nn/hf_adapter.h"

#include <filesystem>

#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "io/paths.h"
#include "nn/model_family.h"

namespace moetrain {

// A config.json of a few kilobytes; the cap keeps /dev/zero-sized mistakes out.
constexpr int64_t kMaxHfConfigBytes = int64_t{16} << 20;

nlohmann::json read_hf_config(const std::string& path) {
  // Regular files only: a FIFO would block open(2), a device never end.
  const std::string text = read_regular_file(path, "a Hugging Face config.json", kMaxHfConfigBytes);
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    MT_THROW("{}: not valid JSON: {}", path, e.what());
  }
  MT_CHECK(j.is_object(), "{}: expected a JSON object", path);
  return j;
}

HfArchitecture read_hf_architecture(const std::string& path) {
  const nlohmann::json j = read_hf_config(path);
  // GPT-2 configs from before transformers wrote model_type have none.
  const std::string type = j.contains("model_type") && j["model_type"].is_string() ? j["model_type"].get<std::string>()
                                                                                    : "gpt2";
  if (const ModelFamily* family = model_family_for_hf_type(type)) return family->read_hf_architecture(path, type);
  std::vector<std::string> types;
  for (const ModelFamily* f : model_families()) types.insert(types.end(), f->hf_model_types.begin(), f->hf_model_types.end());
  MT_THROW("{}: model_type \"{}\" is not one moetrain reads ({})", path, type, fmt::join(types, ", "));
}

bool is_hf_model_dir(const std::string& path) {
  return std::filesystem::is_directory(path) && std::filesystem::exists(std::filesystem::path(path) / "config.json");
}

Tensor read_as(const HfTensorSource& source, const std::string& name, DType dtype) {
  Tensor t = source.read(name);
  MT_CHECK(is_floating(t.dtype()) == is_floating(dtype), "{}: tensor {} is {} but the model's is {}: {} values cannot "
           "stand for {} ones; the file was written for another purpose or is damaged", source.where(name), name,
           t.dtype(), dtype, is_floating(t.dtype()) ? "floating-point" : "integer",
           is_floating(dtype) ? "floating-point" : "integer");
  return t.to(dtype);
}

}  // namespace moetrain
