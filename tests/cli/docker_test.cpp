// docker/Dockerfile does what CI proves: on the OS launch/setup.sh is written
// for, it runs launch/setup.sh and launch/build.sh unchanged, installs nothing
// of setup.sh's list another way, and builds nothing by hand. Its only extra
// layer is the container's own: NVIDIA's CUDA toolkit, NCCL and ssh.
#include <catch2/catch.hpp>

#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "testing.h"

using std::string;

namespace {

string source(const string& path) { return moetrain::testing::read_bytes(string(MOETRAIN_SOURCE_DIR) + "/" + path); }

// Dockerfile instructions with continuation lines joined and comments dropped.
std::vector<string> instructions(const string& text) {
  std::vector<string> out;
  std::stringstream in(text);
  string pending;
  for (string line; std::getline(in, line);) {
    if (line.find_first_not_of(" \t") == string::npos || line[line.find_first_not_of(" \t")] == '#') continue;
    bool more = !line.empty() && line.back() == '\\';
    pending += (pending.empty() ? "" : " ") + (more ? line.substr(0, line.size() - 1) : line);
    if (!more) {
      out.push_back(std::regex_replace(pending, std::regex(R"(\s+)"), " "));
      pending.clear();
    }
  }
  return out;
}

// The packages of launch/setup.sh's `packages=( ... )` array.
std::set<string> setup_packages() {
  const string text = source("launch/setup.sh");
  const auto begin = text.find("packages=(");
  REQUIRE(begin != string::npos);
  const auto end = text.find("\n)", begin);
  REQUIRE(end != string::npos);
  std::stringstream in(text.substr(begin + 10, end - begin - 10));
  std::set<string> out;
  for (string line; std::getline(in, line);) {
    line = line.substr(0, line.find('#'));
    std::stringstream words(line);
    for (string w; words >> w;) out.insert(w);
  }
  return out;
}

// Package names after each `apt-get install` of a RUN command.
std::vector<string> apt_installs(const string& run) {
  std::vector<string> out;
  std::smatch m;
  string rest = run;
  while (std::regex_search(rest, m, std::regex(R"(apt-get install ([^&;|]*))"))) {
    std::stringstream words(m[1].str());
    for (string w; words >> w;)
      if (w[0] != '-') out.push_back(w);
    rest = m.suffix();
  }
  return out;
}

}  // namespace

TEST_CASE("cli: docker/Dockerfile runs launch/setup.sh and launch/build.sh as CI does, on the same OS",
          "[cli][docker]") {
  const std::vector<string> steps = instructions(source("docker/Dockerfile"));
  REQUIRE(!steps.empty());
  // The OS launch/setup.sh installs for.
  CHECK(source("launch/setup.sh").find("Debian 12") != string::npos);
  CHECK(steps.front() == "FROM debian:12");

  std::vector<string> runs;
  size_t copy_at = steps.size();
  for (size_t i = 0; i < steps.size(); ++i) {
    if (steps[i] == "COPY . .") copy_at = i;
    if (steps[i].rfind("RUN ", 0) == 0) runs.push_back(steps[i].substr(4));
  }
  REQUIRE(copy_at < steps.size());
  // The two CI steps, whole and unchanged, after the tree is copied in. CI builds
  // with MOETRAIN_CUDA=AUTO, which is ON where nvcc is (CI machines, the image);
  // the image says ON so that a missing toolkit fails the build.
  const auto at = [&](const string& run) {
    for (size_t i = copy_at; i < steps.size(); ++i)
      if (steps[i] == "RUN " + run) return static_cast<int>(i);
    return -1;
  };
  const int setup = at("launch/setup.sh"), build = at("launch/build.sh -DMOETRAIN_CUDA=ON");
  CHECK(setup > 0);
  CHECK(build > setup);
  CHECK(source("launch/test.sh").find("launch/setup.sh\n") != string::npos);
  CHECK(source("launch/test.sh").find("launch/build.sh -DMOETRAIN_BENCH=OFF") != string::npos);

  // Nothing of setup.sh's list is installed another way; the rest is the container's own layer.
  const std::set<string> ours = setup_packages();
  REQUIRE(ours.count("libopenmpi-dev") == 1);
  REQUIRE(ours.count("catch2") == 1);
  const std::regex container_only(R"(ca-certificates|wget|cuda-toolkit-\$\{CUDA_PACKAGE_VERSION\}|)"
                                  R"(libnccl2|libnccl-dev|openssh-client|openssh-server)");
  int installs = 0;
  for (const string& run : runs)
    for (const string& p : apt_installs(run)) {
      INFO("Dockerfile installs " << p);
      CHECK(ours.count(p) == 0);
      CHECK(std::regex_match(p, container_only));
      ++installs;
    }
  CHECK(installs > 0);
  // No build or package step outside the scripts.
  for (const string& run : runs) {
    INFO("RUN " << run);
    CHECK(!std::regex_search(run, std::regex(R"(\b(cmake|ninja|make|g\+\+|pip3?|python3?)\b)")));
  }
  // The image builds from the tree, not from local builds or runs.
  const string ignore = source(".dockerignore");
  for (const char* p : {"\nbuild\n", "\nbuild-*\n", "\nruns\n", "\n.git\n"}) CHECK(ignore.find(p) != string::npos);
}
