# Setup on the H200 device machine (source it first in every call): the carried wheels (lmdb and
# zstandard for Python 3.12: `python3 -m pip download --no-deps --only-binary=:all:
# --python-version 3.12 --implementation cp --platform manylinux2014_x86_64 -d .whl lmdb zstandard`,
# `.whl` named in carry) and this tree installed into /tmp/site so the providers' entry points
# resolve.  --upgrade matters: a warm machine keeps /tmp/site between calls, and without it pip
# leaves the *previous* call's copy of the library in place (scripts run from benchmarks/ then
# import that stale copy; pytest from the repository root imports the tree itself).
set -e
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
python3 -m pip install -q --upgrade --no-deps --no-build-isolation --no-compile --target /tmp/site . >/dev/null 2>&1
export PYTHONPATH=/tmp/site
python3 -c "import hostkv_providers as hk, torch; print([p.name for p in hk.available_providers()], torch.cuda.get_device_name())"
