#!/usr/bin/env bash
# Installs every Debian 12 package moetrain needs to build, test and train.
# Idempotent: packages already present are skipped and nothing is printed for them.
# Runs apt-get only when something is missing (as root, or through sudo).
set -euo pipefail

packages=(
  # toolchain
  g++ cmake ninja-build pkg-config git
  # math, parallelism, storage
  libopenblas-dev libopenblas-openmp-dev libblis4-openmp libdnnl-dev libopenmpi-dev openmpi-bin libhdf5-dev hdf5-tools
  # logging, config, CLI, JSON, tokenizer regex and NFC, crypto (sha256)
  libspdlog-dev libfmt-dev libyaml-cpp-dev libcli11-dev nlohmann-json3-dev libpcre2-dev libutf8proc-dev libssl-dev
  # prepare's compressed inputs (.gz, .zst)
  zlib1g-dev libzstd-dev
  # tests and benchmarks
  catch2 libbenchmark-dev
  # reference implementations and plotting (system /usr/bin/python3)
  python3 python3-torch python3-numpy python3-h5py python3-regex python3-matplotlib
  # launch/test.sh's venv with HF tokenizers and tiktoken (the live tokenizer comparisons)
  python3-venv
)

missing=()
for p in "${packages[@]}"; do
  status=$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null || true)
  [[ "$status" == "install ok installed" ]] || missing+=("$p")
done
[[ ${#missing[@]} -eq 0 ]] && exit 0

echo "setup: installing ${#missing[@]} Debian package(s): ${missing[*]}" >&2
sudo=()
if [[ $(id -u) -ne 0 ]]; then
  command -v sudo >/dev/null || { echo "setup: need root or sudo to install: ${missing[*]}" >&2; exit 1; }
  sudo=(sudo)
fi
export DEBIAN_FRONTEND=noninteractive
"${sudo[@]}" apt-get update -qq
"${sudo[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
echo "setup: done" >&2
