# Sourced by install.sh, dev-install.sh and test.sh: picks the Python the project installs into
# and gives the scripts their progress and pip helpers.  Sets PY (an interpreter path) and VENV
# (the virtual environment in use, or empty for the system Python).
#
# Which Python:
#   1. HOSTKV_VENV=DIR: that virtual environment (created if missing);
#   2. an activated virtual environment ($VIRTUAL_ENV);
#   3. ./.venv, if an earlier run made it;
#   4. python3 itself, when pip may install into it (CI's and most dev machines');
#   5. otherwise a new ./.venv: a PEP 668 "externally managed" system Python (Debian, Ubuntu,
#      Fedora's python3) refuses `pip install`, and so does a site-packages we cannot write.

_t0=$(date +%s)
step() { printf '[hostkv %3ss] %s\n' "$(( $(date +%s) - _t0 ))" "$*"; }
die() { printf 'error: %s\n' "$1" >&2; [ $# -gt 1 ] && printf 'hint: %s\n' "$2" >&2; exit 1; }

_base=${HOSTKV_PYTHON:-python3}
command -v "$_base" >/dev/null || die "no $_base on PATH" "install Python >= 3.10 (e.g. apt-get install python3 python3-venv)"
"$_base" -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
  || die "$("$_base" -V 2>&1) is too old" "hostkv-providers needs Python >= 3.10 (set HOSTKV_PYTHON=python3.X)"

_make_venv() {
  step "creating a virtual environment in $1 (the system Python does not take pip installs)"
  "$_base" -m venv "$1" || die "could not create a virtual environment in $1" \
    "install the venv module (Debian/Ubuntu: apt-get install python3-venv), or activate one yourself"
}

# 0 when pip may install into this interpreter: pip present, not PEP 668 (a venv never is),
# and its site-packages writable.
_pip_ok() {
  "$1" - <<'PY' 2>/dev/null
import os, sys, sysconfig, importlib.util
in_venv = sys.prefix != sys.base_prefix
managed = os.path.isfile(os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED"))
pip = importlib.util.find_spec("pip") is not None
writable = os.access(sysconfig.get_path("purelib"), os.W_OK)
sys.exit(0 if pip and writable and (in_venv or not managed or os.environ.get("PIP_BREAK_SYSTEM_PACKAGES")) else 1)
PY
}

if [ -n "${HOSTKV_VENV:-}" ]; then
  VENV=$HOSTKV_VENV
  [ -x "$VENV/bin/python" ] || _make_venv "$VENV"
elif [ -n "${VIRTUAL_ENV:-}" ] && [ -x "$VIRTUAL_ENV/bin/python" ]; then
  VENV=$VIRTUAL_ENV
elif [ -x .venv/bin/python ]; then
  VENV=.venv
elif _pip_ok "$_base"; then
  VENV=
else
  VENV=.venv
  _make_venv "$VENV"
fi
if [ -n "$VENV" ]; then
  PY=$(cd "$VENV/bin" && pwd)/python  # absolute: test.sh runs it from cli/ and plugins/ too
  export PATH="$(dirname "$PY"):$PATH"
else
  PY=$(command -v "$_base")
fi
_pip_ok "$PY" || die "pip cannot install into $PY" "activate a virtual environment, or set HOSTKV_VENV=DIR"

# pip with a line per package (not its megabytes of download noise), the whole log kept for
# when it fails: never silent for minutes, never a wall of text.
pip_install() {
  if [ -n "${HOSTKV_PIP_VERBOSE:-}" ]; then
    "$PY" -m pip install --disable-pip-version-check "$@"
    return
  fi
  local log rc=0
  log=$(mktemp "${TMPDIR:-/tmp}/hostkv-pip.XXXXXX")
  "$PY" -m pip install --disable-pip-version-check --progress-bar off "$@" >"$log" 2>&1 &
  local pid=$!
  local shown=0
  while kill -0 "$pid" 2>/dev/null; do
    sleep 2
    local n
    n=$(wc -l <"$log")
    if [ "$n" -gt "$shown" ]; then
      sed -n "$((shown + 1)),${n}p" "$log" \
        | grep -E '^(Collecting|Processing|Building wheel|Installing collected|Successfully)' \
        | sed -e 's/^/    /' -e 's/ (from .*)$//' || true
      shown=$n
    fi
  done
  wait "$pid" || rc=$?
  sed -n "$((shown + 1)),\$p" "$log" \
    | grep -E '^(Collecting|Processing|Building wheel|Installing collected|Successfully)' \
    | sed -e 's/^/    /' -e 's/ (from .*)$//' || true
  if [ "$rc" -ne 0 ]; then
    tail -n 30 "$log" >&2
    rm -f "$log"
    die "pip install failed (exit $rc)" "the lines above are pip's own; rerun with HOSTKV_PIP_VERBOSE=1 for everything"
  fi
  rm -f "$log"
}
