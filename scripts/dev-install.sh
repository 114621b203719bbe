#!/usr/bin/env bash
# Installs everything the demo, the tests and the benchmarks need, on a fresh machine that has
# only Python and pip (and, for the Redis plugin's tests, apt as root).  The same Python as
# scripts/install.sh: the active venv, the system Python when pip may write there, else ./.venv.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_env.sh

# A second run with nothing changed skips pip (its resolver alone takes ~30 s here): the stamp
# names this checkout's path (the editable installs point at it), the interpreter, and the
# hash of everything that decides what gets installed.  HOSTKV_REINSTALL=1 forces a run.
stamp_dir="$("$PY" -c 'import sys; print(sys.prefix)')"
[ -w "$stamp_dir" ] || stamp_dir="${XDG_CACHE_HOME:-$HOME/.cache}/hostkv"
key=$( { echo "$PWD $PY"; cat pyproject.toml cli/pyproject.toml plugins/hostkv-redis/pyproject.toml \
  examples/custom_provider/pyproject.toml scripts/dev-install.sh; } | sha256sum | cut -c1-16)
stamp="$stamp_dir/.hostkv-dev-install-$key"
if [ -z "${HOSTKV_REINSTALL:-}" ] && [ -f "$stamp" ] \
   && "$PY" -c 'import torch, hostkv_providers, hostkv_cli, hostkv_redis, hostkv_dictstore, pytest, mypy, ruff, prometheus_client' 2>/dev/null \
   && { [ "${HOSTKV_SKIP_ENGINES:-0}" = 1 ] || [ -d .engine-site/torchvision ]; } \
   && command -v redis-server >/dev/null && command -v mdb_stat >/dev/null && command -v openssl >/dev/null; then
  step "dev install: up to date (stamp $(basename "$stamp"); HOSTKV_REINSTALL=1 reinstalls)"
  exit 0
fi

# torch stays optional in the library's metadata; the dev/CI path pins the CPU build that these
# machines install from local disk (an unpinned torch would pull a multi-GB CUDA build).
step "dev install into ${VENV:-the system Python} ($("$PY" -V)): torch (CPU), the four distributions editable, test and lint tools"
pip_install "torch==2.13.0"
pip_install -e ".[dev,prometheus]" -e ./cli -e ./plugins/hostkv-redis -e ./examples/custom_provider
# The hybrid-model tests and examples/hybrid_restore map transformers 5.x hybrid caches (Qwen3-Next,
# Bamba); the dev extra allows any transformers >= 4.45 (those tests skip below 5.x), CI pins the
# version they were written against.
pip_install "transformers==5.24.0"

# The engines the adapters are tested against (tests/integrations), pinned, without their
# dependency trees (--no-deps: a full vLLM/SGLang install pulls a CUDA torch and GBs more), plus
# the modules their interface and manager modules import.  Measured on this 2-core machine with
# an empty pip cache: 66 s, 2.3 GB installed.  HOSTKV_SKIP_ENGINES=1 skips it (the tests skip).
if [ "${HOSTKV_SKIP_ENGINES:-0}" != 1 ]; then
  pip_install --no-deps --no-compile \
    vllm==0.33.0 sglang==0.5.23 lmcache==0.5.6 \
    `# vLLM's kv_offload tiering modules` \
    psutil==7.2.2 pyzmq==27.3.0 cbor2==6.3.0 aiohttp==3.14.5 multidict==7.2.1 yarl==1.25.1 \
    propcache==0.5.4 aiohappyeyeballs==2.7.1 aiosignal==1.4.0 frozenlist==1.8.0 openai==3.57.0 \
    openai-harmony==0.0.8 pillow==13.0.0 pybase64==1.5.1 cachetools==8.0.2 msgspec==0.23.0 \
    uvloop==0.23.0 xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2 fastapi==0.165.0 starlette==1.10.0 \
    opentelemetry-api==1.45.2 partial-json-parser==0.2.1.1.post7 llguidance==1.9.1 \
    `# SGLang's hicache_storage (sglang.srt.utils imports triton; CPU import only)` \
    triton==3.9.0 \
    `# LMCache's storage manager (its CPU device ops use numba)` \
    numba==0.68.1 llvmlite==0.50.0 aiofile==3.12.3 caio==0.12.10
  # SGLang's host memory pool and HiCacheController (tests/integrations/_sglang_cpu.py): its
  # mem_cache imports sglang.srt.configs, whose __init__ imports every model config, some of
  # them torchvision's transforms and a few pure-Python modules.  They go into ./.engine-site,
  # not the shared site-packages: PyPI's torchvision is a CUDA build whose C ops cannot load
  # beside the CPU torch, and only the SGLang tests (which declare its two missing op schemas
  # first) may see it.  30 MB.
  pip_install --no-deps --no-compile --upgrade --target .engine-site \
    torchvision==0.28.0 dill==0.4.1 sentencepiece==0.2.3 compressed-tensors==0.20.1 loguru==0.7.3 gguf==0.19.0
fi

# Servers and tools the tests use: redis-server (the Redis plugin's tests start their own on
# loopback), mdb_stat (the LMDB store is checked with LMDB's own tool) and openssl (the TLS
# tests make a throw-away CA and server certificate).
if ! command -v redis-server >/dev/null || ! command -v mdb_stat >/dev/null || ! command -v openssl >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    step "apt-get install redis-server lmdb-utils openssl"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq redis-server lmdb-utils openssl >/dev/null
  else
    echo "warning: redis-server/mdb_stat/openssl missing and apt-get unavailable; their tests will skip" >&2
  fi
fi
mkdir -p "$stamp_dir" && rm -f "$stamp_dir"/.hostkv-dev-install-* && touch "$stamp"
step "dev install done"
