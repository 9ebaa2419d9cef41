// Progress: the text it shows and how often it draws (bar at most 10 Hz on a
// terminal, else a line per 10% or 10 s), on an injected clock.
#include <catch2/catch.hpp>

#include <cstdio>
#include <memory>

#include "data/progress.h"

using namespace moetrain::data;

namespace {

// A FILE* writing into memory, and what was written so far.
struct Capture {
  char* buf = nullptr;
  size_t size = 0;
  std::FILE* file = open_memstream(&buf, &size);
  ~Capture() {
    std::fclose(file);
    std::free(buf);
  }
  std::string text() {
    std::fflush(file);
    return std::string(buf, size);
  }
};

std::vector<std::string> lines_of(const std::string& s) {
  std::vector<std::string> out;
  size_t begin = 0;
  for (size_t nl; (nl = s.find('\n', begin)) != std::string::npos; begin = nl + 1)
    out.push_back(s.substr(begin, nl - begin));
  return out;
}

}  // namespace

TEST_CASE("progress: counts, durations and rates as tqdm shows them", "[data][progress]") {
  CHECK(Progress::format_count(0, true) == "0");
  CHECK(Progress::format_count(999, true) == "999");
  CHECK(Progress::format_count(1000, true) == "1.00k");
  CHECK(Progress::format_count(1234567, true) == "1.23M");
  CHECK(Progress::format_count(45600000, true) == "45.6M");
  CHECK(Progress::format_count(338025, true) == "338k");
  CHECK(Progress::format_count(1234567, false) == "1234567");
  CHECK(Progress::format_duration(0) == "00:00");
  CHECK(Progress::format_duration(65.9) == "01:05");
  CHECK(Progress::format_duration(3723) == "1:02:03");
}

TEST_CASE("progress: off a terminal, one line per 10% and a last one", "[data][progress]") {
  Capture cap;
  double now = 0;
  ProgressOptions o;
  o.mode = ProgressOptions::Mode::lines;
  o.out = cap.file;
  o.clock = [&] { return now; };
  {
    Progress p("work", 100, o);
    for (int i = 0; i < 100; ++i) {
      now += 0.25;
      p.update(1);
    }
  }  // the destructor finishes
  const std::vector<std::string> lines = lines_of(cap.text());
  REQUIRE(lines.size() == 10);
  CHECK(lines[0] == "work:  10% 10/100 [00:02<00:22, 4.00it/s]");
  CHECK(lines[4] == "work:  50% 50/100 [00:12<00:12, 4.00it/s]");
  CHECK(lines[9] == "work: 100% 100/100 [00:25<00:00, 4.00it/s]");
  CHECK(cap.text().find('\r') == std::string::npos);
}

TEST_CASE("progress: off a terminal, a line at least every 10 s", "[data][progress]") {
  Capture cap;
  double now = 0;
  ProgressOptions o;
  o.mode = ProgressOptions::Mode::lines;
  o.out = cap.file;
  o.unit = "tok";
  o.scale = true;
  o.clock = [&] { return now; };
  Progress p("tokenizing", 0, o);  // unknown total: time only
  for (int i = 0; i < 35; ++i) {
    now += 1;
    p.update(2000);
  }
  p.set_postfix("3 files");
  p.finish();
  p.finish();  // idempotent
  const std::vector<std::string> lines = lines_of(cap.text());
  REQUIRE(lines.size() == 4);
  CHECK(lines[0] == "tokenizing: 20.0ktok [00:10, 2.00ktok/s]");
  CHECK(lines[3] == "tokenizing: 70.0ktok [00:35, 2.00ktok/s, 3 files]");
}

TEST_CASE("progress: on a terminal, a bar redrawn in place at most every 0.1 s", "[data][progress]") {
  Capture cap;
  double now = 0;
  ProgressOptions o;
  o.mode = ProgressOptions::Mode::bar;
  o.out = cap.file;
  o.width = 60;
  o.clock = [&] { return now; };
  {
    Progress p("load", 1000, o);
    for (int i = 0; i < 1000; ++i) {
      now += 1.0 / 128;  // exact in binary: 1000 updates take 7.8125 s
      p.update(1);
    }
  }
  const std::string text = cap.text();
  const auto redraws = std::count(text.begin(), text.end(), '\r');
  CHECK(redraws >= 50);
  CHECK(redraws <= 7.8125 / 0.1 + 2);  // <= 10 Hz, plus the first and the last draw
  REQUIRE(text.back() == '\n');
  CHECK(std::count(text.begin(), text.end(), '\n') == 1);
  const std::string last = text.substr(text.rfind('\r') + 1, text.size() - text.rfind('\r') - 2);
  CHECK(last.starts_with("load: 100%|█"));
  CHECK(last.ends_with("| 1000/1000 [00:07<00:00, 128.00it/s]"));
  size_t columns = 0;
  for (char c : last) columns += (static_cast<unsigned char>(c) & 0xC0) != 0x80;
  CHECK(columns == 59);  // the width less one column, so the terminal does not wrap

  // 5/16 of a 28-cell bar is 8 6/8 cells: 8 full blocks, then the 6/8 block.
  Progress part("x", 16, o);
  part.update(5);
  std::string expected = "x:  31%|";
  for (int i = 0; i < 8; ++i) expected += "█";
  expected += "▊" + std::string(19, ' ') + "| 5/16 [00:00<?, ?it/s]";
  CHECK(part.format(true) == expected);
}

TEST_CASE("progress: Mode::off writes nothing", "[data][progress]") {
  Capture cap;
  ProgressOptions o;
  o.mode = ProgressOptions::Mode::off;
  o.out = cap.file;
  {
    Progress p("quiet", 10, o);
    p.update(10);
  }
  CHECK(cap.text().empty());
}

TEST_CASE("progress: delay_s keeps quick work silent and shows slow work from then on", "[data][progress]") {
  for (ProgressOptions::Mode mode : {ProgressOptions::Mode::lines, ProgressOptions::Mode::bar}) {
    Capture quick, slow;
    double now = 0;
    ProgressOptions o;
    o.mode = mode;
    o.delay_s = 2.0;
    o.clock = [&] { return now; };
    o.out = quick.file;
    {
      Progress p("save", 10, o);
      for (int i = 0; i < 10; ++i) {
        now += 0.15;  // 1.5 s in all: below the delay
        p.update(1);
      }
    }
    CHECK(quick.text().empty());
    o.out = slow.file;
    now = 0;
    {
      Progress p("save", 10, o);
      for (int i = 0; i < 10; ++i) {
        now += 0.5;  // reaches the delay at the 4th update (2.0 s)
        p.update(1);
      }
    }
    const std::string text = slow.text();
    CHECK(text.find("save:  30%") == std::string::npos);  // nothing before 2 s
    CHECK(text.find("save: 100%") != std::string::npos);
    if (mode == ProgressOptions::Mode::lines) {
      const std::vector<std::string> lines = lines_of(text);
      REQUIRE(!lines.empty());
      CHECK(lines.front().rfind("save:  40%", 0) == 0);
      CHECK(lines.back() == "save: 100% 10/10 [00:05<00:00, 2.00it/s]");
    }
  }
}
