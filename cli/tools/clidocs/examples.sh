#!/bin/bash
# The docs/cli.md examples: run in an empty work folder holding flip.py and hold.py.
# Prints "$ command", its stdout+stderr and "[exit N]" for each.
rm -rf .hostkv-demo kv kv-old bench-lmdb bench-mmap
r() { echo "\$ $*"; eval "$@" 2>&1; echo "[exit $?]"; echo; }
r hostkv providers
r hostkv demo
r hostkv info lmdb://./.hostkv-demo
r hostkv info --json lmdb://./.hostkv-demo
r hostkv ls --tree lmdb://./.hostkv-demo
r hostkv ls --limit 4 lmdb://./.hostkv-demo
r hostkv stats lmdb://./.hostkv-demo
r hostkv verify lmdb://./.hostkv-demo
r hostkv copy lmdb://./.hostkv-demo "'mmap://./kv?budget=256MiB&slot=64KiB'"
r hostkv copy lmdb://./.hostkv-demo "'mmap://./kv?budget=256MiB&slot=64KiB'"
r hostkv ls --tree mmap://./kv
r python3 flip.py kv 900
r hostkv verify mmap://./kv
r hostkv verify --repair mmap://./kv
r hostkv verify mmap://./kv
r hostkv ls --tree mmap://./kv
TAG=$(hostkv info --json mmap://./kv | python3 -c "import json,sys; print(json.load(sys.stdin)['salt_tags'][0]['tag'])")
r hostkv evict --dry-run --salt $TAG mmap://./kv
KEY=$(hostkv ls --tree --json mmap://./kv | python3 -c "import json,sys; print(json.load(sys.stdin)['runs'][1]['first'][:12])")
r hostkv evict --key $KEY mmap://./kv
r hostkv evict --to 40MiB mmap://./kv
r hostkv compact mmap://./kv
r hostkv ls --tree mmap://./kv
r hostkv bench "'lmdb://./bench-lmdb?budget=1GiB'"
r hostkv bench "'mmap://./bench-mmap?budget=1GiB'"
r hostkv bench "'pinned://?budget=1GiB'"
r hostkv info lmdb://./no-such-store
r hostkv info "'lmdb://./.hostkv-demo?budget=1GiB'"
r hostkv info nosuch://x
r hostkv evict --to 1GiB --salt $TAG mmap://./kv
chmod 755 .hostkv-demo; r hostkv info lmdb://./.hostkv-demo; chmod 700 .hostkv-demo
python3 hold.py mmap://./kv 20 > /dev/null & sleep 3
r hostkv compact mmap://./kv
r hostkv info mmap://./kv \| head -4
wait
cp -a kv kv-old; python3 - <<'PY'
import json; p = "kv-old/manifest.json"; d = json.load(open(p)); d["format_version"] = 999; open(p, "w").write(json.dumps(d))
PY
r hostkv info mmap://./kv-old
# selections that match nothing, a destination that keeps nothing
r hostkv ls --salt nosuch lmdb://./.hostkv-demo
r hostkv evict --salt xyz mmap://./kv
r hostkv copy lmdb://./.hostkv-demo "'pinned://?budget=1GiB'"
# export / import
TAG2=$(hostkv info --json lmdb://./.hostkv-demo | python3 -c "import json,sys; print(json.load(sys.stdin)['salt_tags'][0]['tag'])")
r hostkv export lmdb://./.hostkv-demo demo.hkv --salt $TAG2
r hostkv import demo.hkv "'lmdb://./kv-imported?budget=256MiB'" --expect-salt $TAG2
r hostkv import demo.hkv "'lmdb://./kv-imported?budget=256MiB'"
r hostkv import demo.hkv "'mmap://./kv-other?budget=256MiB'" --expect-salt 0123456789abcdef
FORK=$(hostkv ls --tree --json lmdb://./.hostkv-demo | python3 -c "import json,sys; print(json.load(sys.stdin)['runs'][2]['last'])")
r hostkv export --json lmdb://./.hostkv-demo fork.hkv --key $FORK
python3 - <<'PY'
b = bytearray(open("demo.hkv", "rb").read()); b[len(b) // 3] ^= 0x10; open("bad.hkv", "wb").write(bytes(b))
PY
r hostkv import bad.hkv "'mmap://./kv-bad?budget=256MiB'"
r hostkv import --dry-run demo.hkv lmdb://./kv-imported
