#!/usr/bin/env bash
# The project's test command (the README's second command; .ci/run calls it).
# Each distribution is tested from its own folder with its own pytest configuration, as its
# users would: the core (with the template provider), the CLI, the Redis plugin.
#
# The core suite spends most of its wall time waiting (fsyncs, child processes killed and
# reopened, servers starting: 196 s of CPU in 13.5 min), so mypy (2.3 min of CPU on a cold cache)
# and the CLI's and the plugin's suites run beside it instead of before it; each writes its own
# log, printed whole when it ends, and every exit status counts.  With no arguments the core suite
# itself runs as two shards (tests/providers, and the rest) for the same reason.
# HOSTKV_TEST_SERIAL=1 runs everything one after the other, as before.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/dev-install.sh
source scripts/_env.sh
# The suites' files go under TMPDIR; a run on a disk with too little free failed mid-suite
# (tests erroring at setup), so the log says how much there was.  Peak seen: ~0.6 GB.
step "free disk where the tests write: $(df -Ph "${TMPDIR:-/tmp}" | awk 'NR == 2 {print $4 " of " $2 " (" $6 ")"}')"
step "ruff"
"$PY" -m ruff check .
if [ -n "${HOSTKV_TEST_SERIAL:-}" ]; then
  step "mypy --strict"
  "$PY" -m mypy --strict
  step "pytest: cli"
  (cd cli && "$PY" -m pytest -q "$@")
  step "pytest: plugins/hostkv-redis"
  (cd plugins/hostkv-redis && "$PY" -m pytest -q "$@")
  step "pytest: core"
  "$PY" -m pytest -q "$@"
  step "all tests passed"
  exit 0
fi
logs=$(mktemp -d "${TMPDIR:-/tmp}/hostkv-test.XXXXXX")
trap 'rm -rf "$logs"' EXIT
step "mypy --strict, pytest of cli and plugins/hostkv-redis in the background (logs printed when they end); pytest of the core here"
"$PY" -m mypy --strict >"$logs/mypy" 2>&1 &
mypy_pid=$!
# Each pytest session gets a temp base of its own: sessions that share pytest's numbered
# /tmp/pytest-of-$USER/pytest-N directories rotate them (3 kept), and a shard's directory
# vanished under it once while other pytest runs shared the machine (every test after it
# errored with FileNotFoundError).
(cd cli && exec "$PY" -m pytest -q --basetemp "$logs/tmp-cli" "$@") >"$logs/cli" 2>&1 &
cli_pid=$!
(cd plugins/hostkv-redis && exec "$PY" -m pytest -q --basetemp "$logs/tmp-redis" "$@") >"$logs/redis" 2>&1 &
redis_pid=$!
names="mypy cli redis"
if [ $# -eq 0 ]; then
  # The core's provider tests (kill -9 cycles, crash points, power cuts: child processes started,
  # killed and reopened, i.e. waiting) run as a second shard beside the rest, which waits on its
  # own children (engines' restarts, servers).  Measured in docs/benchmarks.md ("Where the core suite's time goes").
  # tests/providers itself is three shards (lmdb, mmap, the rest): its kill -9 cycles, crash
  # points and damaged-file trials mostly wait on children, so on 2 cores one shard of it was the
  # run's long pole (about 40 of 45 minutes once the damaged-file and counter tests came in).
  step "pytest: core shards tests/providers/{lmdb,mmap,rest} in the background; the rest of the core here"
  "$PY" -m pytest -q --basetemp "$logs/tmp-lmdb" tests/providers/lmdb >"$logs/providers_lmdb" 2>&1 &
  providers_lmdb_pid=$!
  "$PY" -m pytest -q --basetemp "$logs/tmp-mmap" tests/providers/mmap >"$logs/providers_mmap" 2>&1 &
  providers_mmap_pid=$!
  "$PY" -m pytest -q --basetemp "$logs/tmp-providers" tests/providers --ignore=tests/providers/lmdb \
    --ignore=tests/providers/mmap \
    >"$logs/providers_rest" 2>&1 &
  providers_rest_pid=$!
  names="providers_lmdb providers_mmap providers_rest $names"
  core_args=(--ignore=tests/providers)
else
  core_args=("$@")
fi
rc=0
"$PY" -m pytest -q --basetemp "$logs/tmp-core" "${core_args[@]}" || rc=$?
step "pytest: core exited $rc"
for name in $names; do
  pid_var="${name}_pid"
  r=0
  wait "${!pid_var}" || r=$?
  step "$name exited $r; its output:"
  cat "$logs/$name"
  [ "$r" -eq 0 ] || rc=$r
done
[ "$rc" -eq 0 ] && step "all tests passed" || step "tests FAILED"
exit "$rc"
