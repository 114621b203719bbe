"""The server-side half of the provider: Lua scripts run with ``EVALSHA``.

Every multi-key invariant (prefix-closed tree, LRU-leaf eviction, the budget guard, leases,
in-flight reservations, their expiry) is kept *inside* one script call, so it is atomic on the
server: two engine nodes racing can interleave only between whole scripts, never inside one.

Key schema (all keys of a store share the hash tag ``{ns}``, so they live in one Redis Cluster
slot, which scripts need; ``h`` is a page key in lowercase hex, ``rid``/``lid`` are
client-generated reservation/lease ids)::

    hkv:{ns}:m            hash    store metadata and store-wide counters (KEYS[1] of every script)
    hkv:{ns}:e:<h>        hash    sealed entry: p parent-hex, n nbytes, c cost, g salt tag,
                                  k checksum, ct created ms, lu last-used ms, t LRU tick,
                                  r generation (the rid that sealed it), ch children,
                                  lc lease count, fc in-flight children, na anchors,
                                  xp (sharded stores) the parent that lives in another shard,
                                  xs its shard, xm the pin this page holds on it (below),
                                  xc pins held on this page by child groups in other shards,
                                  rt 1 when retained, ra the retain refcount: rt plus the
                                  children (or, sharded, child groups elsewhere) with ra > 0
    hkv:{ns}:x:<h>        hash    pins on h by child groups in other shards: pin -> ms
    hkv:{ns}:xz           zset    pages with pins (x:<h> not empty) by LRU tick
    hkv:{ns}:xo           list    outbox: "<shard> <parent> <pin>" releases still to apply there
    hkv:{ns}:xd           list    drop outbox: "<ms> <pin>" of child groups in other shards whose
                                  parent here was dropped by force (a checksum failure): their
                                  subtrees must go too, which only a client can do
    hkv:{ns}:d:<h>        string  page bytes + 56-byte trailer (key echo, checksum, nbytes, magic)
    hkv:{ns}:c:<h>        set     children hexes (subtree removal)
    hkv:{ns}:a:<h>        hash    anchors: name -> blob
    hkv:{ns}:f:<h>        hash    in-flight reservation: r rid, cl client, p parent, pg parent
                                  generation, c cost, n nbytes, g tag, fk in-flight children
    hkv:{ns}:w:<h>:<rid>  string  staged page bytes, written by SET just before the seal (or put)
                                  script, with the reservation TTL; renamed into d:<h> or deleted
    hkv:{ns}:l:<lid>      list    lease record: [bitmap, h1, gen1, h2, gen2, ...]
    hkv:{ns}:o:<id>       string  the result of an evict call that removed something ("n bytes
                                  skipped"; id client-generated), returned again to a resend
                                  of that call; expires (PX from the client)
    hkv:{ns}:lru          zset    evictable leaves (ch = lc = fc = 0), scored by LRU tick
    hkv:{ns}:fz           zset    in-flight reservations by expiry (ms, server clock)
    hkv:{ns}:lz           zset    leases by expiry (ms, server clock)

A script never raises after it has written (Redis has no rollback): every check comes first.
Per-item outcomes of batch scripts are returned as status strings the client maps to errors.
"""

from __future__ import annotations

__all__ = ["SCRIPTS", "TRAILER_NBYTES"]

#: Bytes appended to every stored page: key (32) + checksum (8) + nbytes (8) + magic (8).
TRAILER_NBYTES = 56

# ``allow-oom``: the bookkeeping scripts must run even when the server is at maxmemory (reads
# refresh LRU ticks, releases/aborts/evictions free space); the page bytes themselves arrive by
# plain SET, which maxmemory still refuses.  Needs Redis >= 7.0 (or Valkey) for script flags.
_PRELUDE = r"""#!lua flags=allow-oom
local M = KEYS[1]
local P = string.sub(M, 1, -2)
local LRU = P .. 'lru'
local FZ = P .. 'fz'
local LZ = P .. 'lz'
local TRAILER = 56

-- Migration guard: in a Redis Cluster slot that is being migrated (MIGRATING), any access to a
-- key the node does not hold makes the script fail *at that command* ("non local key"), with the
-- writes before it already applied (Redis has no rollback).  Touching a key that never exists
-- as the very first command makes every script of a migrating slot fail before it writes
-- anything; the client retries once the slot has moved.  Outside a migration it is one EXISTS.
redis.call('EXISTS', P .. 'never')

local function E(h) return P .. 'e:' .. h end
local function D(h) return P .. 'd:' .. h end
local function C(h) return P .. 'c:' .. h end
local function A(h) return P .. 'a:' .. h end
local function F(h) return P .. 'f:' .. h end
local function W(h, rid) return P .. 'w:' .. h .. ':' .. rid end
local function L(lid) return P .. 'l:' .. lid end
local function X(h) return P .. 'x:' .. h end
local function O(id) return P .. 'o:' .. id end
local XO = P .. 'xo'
local XD = P .. 'xd'
local XZ = P .. 'xz'

-- An evict call's result, remembered under its client-generated id: a resend of the call (its
-- reply was lost; redis-py resends) must not evict again.  Only a call that removed something
-- is remembered (one that removed nothing may as well run again).
local function recalled(id)
  local got = redis.call('GET', O(id))
  if not got then return nil end
  local n, b, s = string.match(got, '^(%d+) (%d+) (%d+)$')
  return {tonumber(n), tonumber(b), tonumber(s)}
end

local function remember(id, ttl, n, b, s)
  if n > 0 then redis.call('SET', O(id), string.format('%d %d %d', n, b, s), 'PX', ttl) end
  return {n, b, s}
end

-- A parent argument '>' .. parent .. ' ' .. its shard .. ' ' .. pin: the sharded store's
-- group-first page, whose parent lives in another shard (recorded as xp/xs, not linked here) and
-- holds the pin `xm` (a member of that parent's x: hash, placed there before this page is).
-- Returns local parent, xp, xs, xm.
local function remote(p)
  if string.sub(p, 1, 1) ~= '>' then return p, '', '', '' end
  local xp, xs, xm = string.match(p, '^>(%x+) ?(%d*) ?(.*)$')
  return '', xp, xs, xm
end

-- A group-first page (or its reservation) that holds a pin on a parent in another shard is
-- going away: queue the release.  No script can reach the other shard; a client drains this
-- outbox into idempotent releases there (until then the parent stays pinned: the safe side).
local function xrelease(xs, xp, xm)
  if xm and xm ~= '' then redis.call('RPUSH', XO, xs .. ' ' .. xp .. ' ' .. xm) end
end

local function need_store()
  if redis.call('HEXISTS', M, 'budget') == 0 then
    error({err = 'HKV_NOSTORE store metadata is missing (server restarted empty or flushed)'})
  end
end

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function mget(field) return tonumber(redis.call('HGET', M, field) or '0') end
local function mincr(field, d) if d ~= 0 then redis.call('HINCRBY', M, field, d) end end

-- Keep LRU = exactly the sealed entries with no children, no leases, no in-flight children and
-- no pins from child groups in other shards (xc, sharded stores).
local function maybe_leaf(h)
  local v = redis.call('HMGET', E(h), 'ch', 'lc', 'fc', 't', 'xc', 'rt')
  if not v[4] then return end
  if tonumber(v[1]) == 0 and tonumber(v[2]) == 0 and tonumber(v[3]) == 0 and tonumber(v[5] or '0') == 0
     and v[6] ~= '1' then
    redis.call('ZADD', LRU, v[4], h)
  else
    redis.call('ZREM', LRU, h)
  end
end

-- The retain refcount (ra) of h changes by d (+1/-1): on 0 -> 1 and 1 -> 0 its bytes join or
-- leave retained_bytes and the change goes on to its parent; a local root of a sharded store
-- reports its parent in another shard ("<shard> <hex>" into `remote`), which the client carries on.
local function ra_walk(h, d, remote)
  local x = h
  while x and x ~= '' do
    local ra = redis.call('HINCRBY', E(x), 'ra', d)
    if (d > 0 and ra ~= 1) or (d < 0 and ra ~= 0) then return end
    local v = redis.call('HMGET', E(x), 'c', 'p', 'xp', 'xs')
    mincr('retained_bytes', d * tonumber(v[1]))
    if v[2] == '' and v[3] and v[3] ~= '' and remote then remote[#remote + 1] = v[4] .. ' ' .. v[3] end
    x = v[2]
  end
end

-- Remove one sealed entry (a leaf, or forced by a subtree drop that goes deepest first).
local function remove_entry(h)
  local v = redis.call('HMGET', E(h), 'p', 'c', 'na', 'lc', 'xs', 'xp', 'xm', 'rt', 'ra', 'xc')
  if not v[2] then return 0 end
  local c = tonumber(v[2])
  -- Only a forced drop (a checksum failure) removes a retained entry or an ancestor of one;
  -- deepest first, so its own mark is all that is left of its refcount.
  if v[8] == '1' then
    mincr('retained', -1)
    ra_walk(h, -1, nil)  -- (a parent in another shard keeps its count: it stays, the safe side)
  elseif tonumber(v[9] or '0') > 0 then
    -- Covered only by retained pages in child groups of other shards (here the subtree goes
    -- deepest first, so its own children already took their counts back): those go with the
    -- cascade, so this page no longer covers its parent here either.
    mincr('retained_bytes', -c)
    if v[1] and v[1] ~= '' then ra_walk(v[1], -1, nil) end
  end
  -- Pins of child groups in other shards: only a forced drop removes a pinned page, and its
  -- subtree there must go with it (the prefix rule), which no script here can reach.  Queued in
  -- the drop outbox in this same step, so a client that dies before carrying it out leaves it to
  -- the others (RedisShardedProvider._drain).  X(h) itself stays until those children's own
  -- removals release their pins (through their outboxes), as after any removal.
  if tonumber(v[10] or '0') > 0 then
    local t = now_ms()
    for _, m in ipairs(redis.call('HKEYS', X(h))) do redis.call('RPUSH', XD, t .. ' ' .. m) end
  end
  redis.call('DEL', E(h), D(h), A(h), C(h))
  xrelease(v[5], v[6], v[7])
  redis.call('ZREM', LRU, h)
  mincr('used', -c)
  mincr('sealed', -c)
  mincr('entries', -1)
  mincr('anchors', -tonumber(v[3] or '0'))
  if tonumber(v[4] or '0') > 0 then mincr('leased', -1) end
  local p = v[1]
  if p and p ~= '' and redis.call('EXISTS', E(p)) == 1 then
    redis.call('SREM', C(p), h)
    redis.call('HINCRBY', E(p), 'ch', -1)
    maybe_leaf(p)
  end
  return c
end

-- Release an in-flight reservation: its cost, and the hold on its parent (matched by generation
-- so a stale reservation can never unpin a parent that was dropped and sealed again).
local function cancel_flight(h)
  local f = redis.call('HMGET', F(h), 'r', 'p', 'pg', 'c', 'xs', 'xp', 'xm')
  if not f[1] then
    redis.call('ZREM', FZ, h)
    return
  end
  xrelease(f[5], f[6], f[7])
  mincr('used', -tonumber(f[4]))
  local p = f[2]
  if p ~= '' then
    if redis.call('HGET', E(p), 'r') == f[3] then
      redis.call('HINCRBY', E(p), 'fc', -1)
      maybe_leaf(p)
    elseif redis.call('HGET', F(p), 'r') == f[3] then
      redis.call('HINCRBY', F(p), 'fk', -1)
    end
  end
  redis.call('DEL', F(h), W(h, f[1]))
  redis.call('ZREM', FZ, h)
end

local function release_lease(lid)
  local items = redis.call('LRANGE', L(lid), 1, -1)
  for i = 1, #items, 2 do
    local h, g = items[i], items[i + 1]
    if redis.call('HGET', E(h), 'r') == g then
      local lc = redis.call('HINCRBY', E(h), 'lc', -1)
      if lc == 0 then
        mincr('leased', -1)
        maybe_leaf(h)
      end
    end
  end
  redis.call('DEL', L(lid))
  redis.call('ZREM', LZ, lid)
end

-- Expire leases and reservations of crashed (or stalled, unrenewed) clients.  Bounded per call;
-- every mutating script reaps, so a backlog drains over a few calls.
local function reap(now)
  local ex = redis.call('ZRANGEBYSCORE', LZ, '-inf', now, 'LIMIT', 0, 256)
  for _, lid in ipairs(ex) do release_lease(lid) end
  if #ex > 0 then mincr('expired_leases', #ex) end
  ex = redis.call('ZRANGEBYSCORE', FZ, '-inf', now, 'LIMIT', 0, 256)
  for _, h in ipairs(ex) do cancel_flight(h) end
  if #ex > 0 then mincr('expired_reservations', #ex) end
end

local function heap_push(H, s, h)
  local n = #H + 1
  H[n] = {s, h}
  while n > 1 do
    local q = math.floor(n / 2)
    if H[q][1] <= H[n][1] then break end
    H[q], H[n] = H[n], H[q]
    n = q
  end
end

local function heap_pop(H)
  local top = H[1]
  local n = #H
  H[1] = H[n]
  H[n] = nil
  n = n - 1
  local i = 1
  while true do
    local l, r, m = 2 * i, 2 * i + 1, i
    if l <= n and H[l][1] < H[m][1] then m = l end
    if r <= n and H[r][1] < H[m][1] then m = r end
    if m == i then break end
    H[i], H[m] = H[m], H[i]
    i = m
  end
  return top
end

-- Plan LRU-leaf evictions that free at least `need`, never touching `protect` (so not its
-- ancestors either).  Removing a leaf may expose its parent as a new leaf: it joins a local heap
-- merged with the LRU zset by tick, so the plan is the exact peeling order.  Returns the keys in
-- removal order, or nil (partial=false) when even every evictable entry would not be enough:
-- the caller then raises CapacityError having evicted nothing.
local function plan(need, protect, partial)
  local out, freed, gone, H = {}, 0, {}, {}
  local off, zs, zi, exhausted = 0, {}, 1, false
  while freed < need do
    if zi > #zs and not exhausted then
      zs = redis.call('ZRANGE', LRU, off, off + 255, 'WITHSCORES')
      off = off + 256
      zi = 1
      if #zs == 0 then exhausted = true end
    end
    local h
    if zi <= #zs and (#H == 0 or tonumber(zs[zi + 1]) <= H[1][1]) then
      h = zs[zi]
      zi = zi + 2
    elseif #H > 0 then
      h = heap_pop(H)[2]
    else
      if partial then return out end
      return nil
    end
    if h ~= protect then
      local v = redis.call('HMGET', E(h), 'c', 'p')
      if v[1] then
        freed = freed + tonumber(v[1])
        out[#out + 1] = h
        local p = v[2]
        if p ~= '' and p ~= protect then
          gone[p] = (gone[p] or 0) + 1
          local pv = redis.call('HMGET', E(p), 'ch', 'lc', 'fc', 't', 'xc', 'rt')
          if pv[4] and tonumber(pv[1]) == gone[p] and tonumber(pv[2]) == 0 and tonumber(pv[3]) == 0
             and tonumber(pv[5] or '0') == 0 and pv[6] ~= '1' then
            heap_push(H, tonumber(pv[4]), p)
          end
        end
      end
    end
  end
  return out
end

local function evict_all(victims)
  local n, b = 0, 0
  for _, h in ipairs(victims) do
    b = b + remove_entry(h)
    n = n + 1
  end
  mincr('evictions', n)
  mincr('evicted_bytes', b)
  return n, b
end

-- The budget guard: make room for `cost` more, or return nil having evicted nothing.
local function make_room(cost, protect)
  local budget, used = mget('budget'), mget('used')
  if used + cost <= budget then return 0 end
  if cost > budget or used + cost - mget('sealed') > budget then return nil end
  local victims = plan(used + cost - budget, protect, false)
  if not victims then return nil end
  local n = evict_all(victims)
  return n
end

local function subtree(roots)
  -- Breadth-first from the top, so reversing the order puts every node after all of its
  -- descendants.  Roots that lie under another root are found first and not started from: a
  -- descendant seeded before its ancestor would come out *after* it once reversed, and the
  -- ancestor (still with a child) would be skipped.
  local start, seen, q, qi, covered = {}, {}, {}, 1, {}
  for _, h in ipairs(roots) do
    if not seen[h] and redis.call('EXISTS', E(h)) == 1 then
      seen[h] = true
      start[#start + 1] = h
      q[#q + 1] = h
    end
  end
  while qi <= #q do
    local x = q[qi]
    qi = qi + 1
    for _, c in ipairs(redis.call('SMEMBERS', C(x))) do
      if seen[c] then
        covered[c] = true
      else
        seen[c] = true
        q[#q + 1] = c
      end
    end
  end
  local order, visited = {}, {}
  for _, h in ipairs(start) do
    if not covered[h] then
      visited[h] = true
      order[#order + 1] = h
    end
  end
  qi = 1
  while qi <= #order do
    local x = order[qi]
    qi = qi + 1
    for _, c in ipairs(redis.call('SMEMBERS', C(x))) do
      if not visited[c] then
        visited[c] = true
        order[#order + 1] = c
      end
    end
  end
  return order
end"""

# KEYS[1] meta; ARGV: format, key algorithm, checksum algorithm, budget ('' = keep), resize 0/1
_INIT = r"""
local fv, ka, ca, budget, resize = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5] == '1'
if redis.call('HEXISTS', M, 'budget') == 0 then
  if budget == '' then budget = ARGV[6] end
  redis.call('HSET', M, 'format', fv, 'key_algorithm', ka, 'checksum', ca, 'budget', budget,
             'used', 0, 'sealed', 0, 'entries', 0, 'tick', 0, 'anchors', 0, 'leased', 0,
             'evictions', 0, 'evicted_bytes', 0, 'checksum_failures', 0, 'seals', 0,
             'created', now_ms())
  return {'created', budget}
end
local cur = redis.call('HMGET', M, 'format', 'key_algorithm', 'checksum', 'budget')
if cur[1] ~= fv or cur[2] ~= ka or cur[3] ~= ca then
  return {'incompatible', tostring(cur[1]), tostring(cur[2]), tostring(cur[3])}
end
if budget ~= '' and budget ~= cur[4] then
  if not resize then return {'budget', cur[4]} end
  local nb = tonumber(budget)
  local used = mget('used')
  if used > nb then
    reap(now_ms())
    used = mget('used')
    if used > nb then
      local victims = plan(used - nb, nil, false)
      if not victims then return {'shrink', cur[4], tostring(used)} end
      evict_all(victims)
    end
  end
  redis.call('HSET', M, 'budget', budget)
  return {'resized', budget}
end
return {'opened', cur[4]}
"""

# ARGV: client, ttl_ms, allow_inflight_parent, count, then count x (h, parent|'', cost, nbytes, tag, rid)
_RESERVE = r"""
need_store()
local now = now_ms()
reap(now)
local cl, ttl, allow, n = ARGV[1], tonumber(ARGV[2]), ARGV[3] == '1', tonumber(ARGV[4])
local out = {}
local i = 5
-- The common case (it fits) keeps the budget arithmetic in locals and writes 'used' once at the
-- end; before make_room (which reads and evicts through the metadata) the pending sum is flushed.
local budget, used, pending = mget('budget'), mget('used'), 0
for k = 1, n do
  local h, p, cost, nb, tag, rid = ARGV[i], ARGV[i + 1], tonumber(ARGV[i + 2]), ARGV[i + 3], ARGV[i + 4], ARGV[i + 5]
  i = i + 6
  local xp, xs, xm
  p, xp, xs, xm = remote(p)  -- '>' ...: the parent lives in another shard (recorded, not linked)
  local st
  if redis.call('EXISTS', E(h)) == 1 then
    st = 'dup'
  else
    local fr = redis.call('HGET', F(h), 'r')
    if fr then
      if fr == rid then st = 'ok' else st = 'busy' end  -- same rid: a retried call, already done
    else
      local pg, pflight = '', false
      if p ~= '' then
        pg = redis.call('HGET', E(p), 'r')
        if not pg then
          local pf = redis.call('HMGET', F(p), 'r', 'cl')
          if allow and pf[1] and pf[2] == cl then
            pg, pflight = pf[1], true
          end
        end
      end
      if not pg then
        st = 'noparent'
      else
        local protect = nil
        if p ~= '' and not pflight then protect = p end
        local fits = used + cost <= budget
        if not fits then
          mincr('used', pending)
          pending = 0
          fits = make_room(cost, protect) ~= nil
          used = mget('used')
        end
        if not fits then
          st = 'cap ' .. budget .. ' ' .. used .. ' ' .. mget('sealed')
        else
          redis.call('HSET', F(h), 'r', rid, 'cl', cl, 'p', p, 'pg', pg, 'c', cost, 'n', nb, 'g', tag, 'fk', 0,
                     'xp', xp, 'xs', xs, 'xm', xm)
          redis.call('ZADD', FZ, now + ttl, h)
          used = used + cost
          pending = pending + cost
          if pflight then
            redis.call('HINCRBY', F(p), 'fk', 1)
          elseif p ~= '' then
            redis.call('HINCRBY', E(p), 'fc', 1)
            redis.call('ZREM', LRU, p)
          end
          st = 'ok'
        end
      end
    end
  end
  out[k] = st
end
mincr('used', pending)
return out
"""

# ARGV: count, then count x (h, rid, checksum).  Items are sealed in order (parents first).
_SEAL = r"""
need_store()
local now = now_ms()
reap(now)
local n = tonumber(ARGV[1])
local out = {}
local i = 2
local t0 = redis.call('HINCRBY', M, 'tick', n) - n
local sealed, entries, written = 0, 0, 0
for k = 1, n do
  local h, rid, ck = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  i = i + 3
  local st
  local f = redis.call('HMGET', F(h), 'r', 'p', 'pg', 'c', 'n', 'g', 'fk', 'xp', 'xs', 'xm')
  if f[1] ~= rid then
    if redis.call('HGET', E(h), 'r') == rid then st = 'ok' else st = 'lost' end
    -- A resent pipeline (its reply was lost after this script ran) SET the staging key again:
    -- never renamed now, it would sit on the server uncounted until its TTL.
    redis.call('DEL', W(h, rid))
  else
    local w = W(h, rid)
    if redis.call('STRLEN', w) ~= tonumber(f[5]) + TRAILER then
      cancel_flight(h)
      st = 'nodata'
    elseif f[2] ~= '' and redis.call('HGET', E(f[2]), 'r') ~= f[3] then
      cancel_flight(h)
      st = 'noparent'
    else
      redis.call('RENAME', w, D(h))
      redis.call('PERSIST', D(h))  -- RENAME keeps the staging key's TTL: a page must not expire
      local t = t0 + k
      local fk = tonumber(f[7])
      local xc = redis.call('HLEN', X(h))  -- child groups already pinned this key (sharded stores)
      redis.call('HSET', E(h), 'p', f[2], 'n', f[5], 'c', f[4], 'g', f[6], 'k', ck, 'ct', now, 'lu', now,
                 't', t, 'r', rid, 'ch', 0, 'lc', 0, 'fc', fk, 'na', 0, 'xc', xc)
      if f[8] and f[8] ~= '' then redis.call('HSET', E(h), 'xp', f[8], 'xs', f[9], 'xm', f[10]) end
      if fk == 0 and xc == 0 then redis.call('ZADD', LRU, t, h) end
      if xc > 0 then redis.call('ZADD', XZ, t, h) end
      if f[2] ~= '' then
        redis.call('SADD', C(f[2]), h)
        redis.call('HINCRBY', E(f[2]), 'ch', 1)
        redis.call('HINCRBY', E(f[2]), 'fc', -1)
        redis.call('ZREM', LRU, f[2])
      end
      sealed = sealed + tonumber(f[4])
      entries = entries + 1
      written = written + tonumber(f[5])
      redis.call('DEL', F(h))
      redis.call('ZREM', FZ, h)
      st = 'ok'
    end
  end
  out[k] = st
end
mincr('sealed', sealed)
mincr('entries', entries)
mincr('seals', entries)
mincr('bytes_written', written)
return out
"""

# ARGV: pairs (h, parent|'').  What put_many needs before it ships any bytes: per key 's'
# (sealed: dedup), 'f' (another writer's live reservation holds it) or '0'.  Reaps first, so a
# dead client's expired reservation does not read as in flight.  A key whose parent was found
# absent earlier in the call is absent too (the tree is prefix-closed), so a new chain costs one
# lookup, not one per page.  (It could still be in flight after its parent was dropped: the put
# script checks that again; a probe only saves bandwidth, it decides nothing.)
_PROBE = r"""
reap(now_ms())
local out, absent = {}, {}
for i = 1, #ARGV, 2 do
  local h, p = ARGV[i], ARGV[i + 1]
  local st = '0'
  if p ~= '' and absent[p] then
    absent[h] = true
  -- one call for the common case (neither): a key is never sealed and in flight at once
  elseif redis.call('EXISTS', E(h), F(h)) > 0 then
    if redis.call('EXISTS', E(h)) == 1 then st = 's' else st = 'f' end
  else
    absent[h] = true
  end
  out[#out + 1] = st
end
return table.concat(out)
"""

# ARGV: tag, base id, count, then count x (h, parent|'', nbytes, checksum).  put_many's publish
# step: the pages' bytes were SET to staging keys W(h, base.k) earlier in the same pipeline, and
# this one call does for each what reserve + seal do for a single page (dedup, in-flight check,
# parent check, budget guard with LRU-leaf eviction, RENAME into place), in order, parents first.
# Per item 'ok', 'dup', 'busy', 'noparent', 'nodata' or 'cap budget used sealed'; every staging
# key not renamed is deleted.  Idempotent: an entry whose generation is this call's id reports
# 'ok' again on a retry.
#
# Why it looks like this: the time of a small-page batch was the per-page commands on Redis's
# single thread (each redis.call costs a few microseconds besides its work).  So no reservation
# record is created and deleted per page, and the entries published by this call ('mine') are
# written at the end, each in one HSET that already has its final child count, and join the
# LRU set then (the ones still leaves).  Until then nothing outside this call can see them (a
# script is atomic) and make_room cannot evict them: they are not in the LRU set, and their
# ancestors have children.
_PUT = r"""
need_store()
local now = now_ms()
reap(now)
local tag, base, n = ARGV[1], ARGV[2], tonumber(ARGV[3])
local out = {}
local t0 = redis.call('HINCRBY', M, 'tick', n) - n
-- Budget arithmetic stays in locals; the pending sums are flushed before make_room, which reads
-- (and evicts through) the metadata.
local budget, used, pused, psealed, written = mget('budget'), mget('used'), 0, 0, 0
local mine, order = {}, {}
local i = 4
for k = 1, n do
  local h, p, nbs, ck = ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3]
  local nb = tonumber(nbs)
  i = i + 4
  local xp, xs, xm
  p, xp, xs, xm = remote(p)  -- '>' ...: a parent in another shard
  local rid = base .. '.' .. k
  local w = W(h, rid)
  local st
  if mine[h] then
    st = 'dup'  -- the same key twice in one call
  elseif redis.call('EXISTS', E(h), F(h)) > 0 then
    local g = redis.call('HGET', E(h), 'r')
    if not g then
      st = 'busy'
    elseif g == rid then
      st = 'ok'  -- a retried call, already done
    else
      st = 'dup'
    end
  elseif p ~= '' and not mine[p] and redis.call('EXISTS', E(p)) == 0 then
    st = 'noparent'
  else
    local fits = used + nb <= budget
    if not fits then
      -- Evict only for a page whose bytes did arrive.
      if redis.call('STRLEN', w) == nb + TRAILER then
        mincr('used', pused)
        mincr('sealed', psealed)
        pused, psealed = 0, 0
        local protect = nil
        if p ~= '' then protect = p end
        fits = make_room(nb, protect) ~= nil
        used = mget('used')
        if not fits then st = 'cap ' .. budget .. ' ' .. used .. ' ' .. mget('sealed') end
      else
        st = 'nodata'
      end
    end
    if fits then
      -- pcall: a missing staging key (the SET was refused at maxmemory, or it expired) is a
      -- per-page outcome, not an error that would abort the script halfway.
      if not redis.pcall('RENAME', w, D(h)).err then
        redis.call('PERSIST', D(h))  -- RENAME keeps the staging key's TTL: a page must not expire
        mine[h] = {p, nbs, ck, t0 + k, rid, 0, xp, xs, xm}
        order[#order + 1] = h
        if p ~= '' then
          redis.call('SADD', C(p), h)
          if mine[p] then
            mine[p][6] = mine[p][6] + 1
          else
            redis.call('HINCRBY', E(p), 'ch', 1)
            redis.call('ZREM', LRU, p)
          end
        end
        used = used + nb
        pused = pused + nb
        psealed = psealed + nb
        written = written + nb
        st = 'ok'
        w = nil
      else
        st = 'nodata'
      end
    end
  end
  if w then redis.call('DEL', w) end
  out[k] = st
end
local z = {}
for _, h in ipairs(order) do
  local e = mine[h]
  local xc = redis.call('HLEN', X(h))  -- child groups already pinned this key (sharded stores)
  redis.call('HSET', E(h), 'p', e[1], 'n', e[2], 'c', e[2], 'g', tag, 'k', e[3], 'ct', now, 'lu', now,
             't', e[4], 'r', e[5], 'ch', e[6], 'lc', 0, 'fc', 0, 'na', 0, 'xc', xc)
  if e[7] ~= '' then redis.call('HSET', E(h), 'xp', e[7], 'xs', e[8], 'xm', e[9]) end
  if xc > 0 then redis.call('ZADD', XZ, e[4], h) end
  if e[6] == 0 and xc == 0 then
    z[#z + 1] = e[4]
    z[#z + 1] = h
    if #z >= 2000 then
      redis.call('ZADD', LRU, unpack(z))
      z = {}
    end
  end
end
if #z > 0 then redis.call('ZADD', LRU, unpack(z)) end
mincr('used', pused)
mincr('sealed', psealed)
mincr('entries', #order)
mincr('seals', #order)
mincr('bytes_written', written)
return out
"""

# ARGV: count, then count x (h, rid).  Idempotent.
_ABORT = r"""
local n = tonumber(ARGV[1])
local done = 0
for k = 0, n - 1 do
  local h, rid = ARGV[2 + 2 * k], ARGV[3 + 2 * k]
  if redis.call('HGET', F(h), 'r') == rid then
    cancel_flight(h)
    done = done + 1
  end
end
mincr('aborts', done)
return done
"""

# ARGV: lid, ttl_ms, hexes...  Returns the presence bitmap ('1'/'0' per key).
_LEASE = r"""
need_store()
local now = now_ms()
reap(now)
local lid, ttl = ARGV[1], tonumber(ARGV[2])
if redis.call('EXISTS', L(lid)) == 1 then return redis.call('LINDEX', L(lid), 0) end
local bits, items = {}, {}
local n = #ARGV - 2
local t0 = redis.call('HINCRBY', M, 'tick', n) - n
for i = 3, #ARGV do
  local h = ARGV[i]
  local v = redis.call('HMGET', E(h), 'r', 'lc')
  if v[1] then
    if tonumber(v[2]) == 0 then
      mincr('leased', 1)
      redis.call('ZREM', LRU, h)
    end
    redis.call('HINCRBY', E(h), 'lc', 1)
    redis.call('HSET', E(h), 't', t0 + i - 2, 'lu', now)
    redis.call('ZADD', XZ, 'XX', t0 + i - 2, h)  -- a pinned page's LRU position (sharded stores)
    bits[#bits + 1] = '1'
    items[#items + 1] = h
    items[#items + 1] = v[1]
  else
    bits[#bits + 1] = '0'
  end
end
local b = table.concat(bits)
if #items > 0 then
  redis.call('RPUSH', L(lid), b)
  for j = 1, #items, 2000 do
    redis.call('RPUSH', L(lid), unpack(items, j, math.min(j + 1999, #items)))
  end
  redis.call('ZADD', LZ, now + ttl, lid)
end
return b
"""

# ARGV: lids...
_RELEASE = r"""
for i = 1, #ARGV do release_lease(ARGV[i]) end
return #ARGV
"""

# ARGV: lease_ttl_ms, reservation_ttl_ms, nleases, lids..., then pairs (h, rid) of reservations.
# Returns the ids that were already gone (expired or lost in a restart).
_RENEW = r"""
need_store()
local now = now_ms()
reap(now)
local lttl, fttl, nl = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local lost = {}
for i = 4, 3 + nl do
  if redis.call('ZSCORE', LZ, ARGV[i]) then
    redis.call('ZADD', LZ, 'XX', now + lttl, ARGV[i])
  else
    lost[#lost + 1] = ARGV[i]
  end
end
for i = 4 + nl, #ARGV, 2 do
  local h, rid = ARGV[i], ARGV[i + 1]
  if redis.call('HGET', F(h), 'r') == rid then
    redis.call('ZADD', FZ, 'XX', now + fttl, h)
  else
    lost[#lost + 1] = rid
  end
end
return lost
"""

# ARGV: hexes... -> bitmap
_PRESENT = r"""
local bits = {}
for i = 1, #ARGV do
  bits[i] = redis.call('EXISTS', E(ARGV[i])) == 1 and '1' or '0'
end
return table.concat(bits)
"""

# ARGV: hexes... (the keys of a chain lookup that fall in this shard, in chain order) -> per key
# '0' (not stored), '1' (stored, its parent here is the previous argument), '2' (stored, a local
# root: depth 0 in its placement group) or '3' (stored, another parent).  The sharded store's
# chain lookups: presence as _PRESENT, and which placement depths the server confirms (a client
# remembers only those, never one computed from a caller's list that is not one chain).
_LINKS = r"""
local out = {}
for i = 1, #ARGV do
  local p = redis.call('HGET', E(ARGV[i]), 'p')
  if not p then
    out[i] = '0'
  elseif p == '' then
    out[i] = '2'
  elseif i > 1 and p == ARGV[i - 1] then
    out[i] = '1'
  else
    out[i] = '3'
  end
end
return table.concat(out)
"""

# -> {last-used ms of this shard's least recently used evictable leaf (-1: none), used bytes}: the
# sharded store's evict(nbytes) starts with the shard whose oldest leaf is oldest.
_LRU_HEAD = r"""
local z = redis.call('ZRANGE', LRU, 0, 0)
local lu = -1
if #z > 0 then lu = tonumber(redis.call('HGET', E(z[1]), 'lu') or '0') end
return {lu, mget('used')}
"""

# ARGV: hexes... -> count of leading stored keys
_PREFIX = r"""
local n = 0
for i = 1, #ARGV do
  if redis.call('EXISTS', E(ARGV[i])) == 0 then break end
  n = i
end
return n
"""

# ARGV: hexes... (the keys just read, in the same pipeline as their GETs): refresh their LRU
# position, and count the store-wide read counters (hits: an entry with its bytes; a page the
# client then finds damaged is moved back to misses by the drop script).
_TOUCH = r"""
if redis.call('EXISTS', M) == 0 then return 0 end  -- never create a store without its identity
local now = now_ms()
local n = #ARGV
local t0 = redis.call('HINCRBY', M, 'tick', n) - n
local hits, nbytes = 0, 0
for i = 1, n do
  local h = ARGV[i]
  local nb = redis.call('HGET', E(h), 'n')
  if nb then
    redis.call('HSET', E(h), 't', t0 + i, 'lu', now)
    redis.call('ZADD', XZ, 'XX', t0 + i, h)  -- a pinned page's LRU position (sharded stores)
    redis.call('ZADD', LRU, 'XX', t0 + i, h)
    if redis.call('EXISTS', D(h)) == 1 then
      hits = hits + 1
      nbytes = nbytes + tonumber(nb)
    end
  end
end
mincr('hits', hits)
mincr('misses', n - hits)
mincr('bytes_read', nbytes)
return n
"""

# ARGV: h [, gen [, 'read' [, digest]]].  Force-removes the subtree of a page whose bytes failed
# verification.  With a generation, only if the entry is still the one that failed (not dropped
# and sealed again); with a digest (SHA-1 hex of the value as the client read it, page and
# trailer; 'none': the value was missing), only if that is still what is stored: a reader knows
# the bytes it got, not the generation they belonged to (its GET and the entry's metadata are not
# read atomically), and a late drop must never remove a page sealed again since (with its
# subtree).  'read': a read found it, so the touch script counted a hit that was a miss.
_DROP = r"""
local h, gen, digest = ARGV[1], ARGV[2], ARGV[4]
if gen and gen ~= '' and redis.call('HGET', E(h), 'r') ~= gen then return 0 end
if digest and digest ~= '' then
  local v = redis.call('GET', D(h))
  if digest == 'none' then
    if v then return 0 end
  elseif not v or redis.sha1hex(v) ~= digest then
    return 0
  end
end
if ARGV[3] == 'read' then
  local nb = redis.call('HGET', E(h), 'n')
  if nb then
    mincr('hits', -1)
    mincr('misses', 1)
    mincr('bytes_read', -tonumber(nb))
  end
end
local order = subtree({h})
for i = #order, 1, -1 do remove_entry(order[i]) end
if #order > 0 then mincr('checksum_failures', 1) end
return #order
"""

# ARGV: hexes... (keys whose GET missed).  Atomically, per key: if the entry's metadata exists but
# its bytes do not (deleted outside this library: server-side maxmemory eviction, an operator's
# DEL), drop its subtree.  Checked here, not by the client after its GET missed, because a seal
# may land in between.  Returns how many of the keys were orphans.
_DROP_ORPHAN = r"""
local n = 0
for i = 1, #ARGV do
  local h = ARGV[i]
  if redis.call('EXISTS', E(h)) == 1 and redis.call('EXISTS', D(h)) == 0 then
    local order = subtree({h})
    for j = #order, 1, -1 do remove_entry(order[j]) end
    mincr('checksum_failures', 1)
    n = n + 1
  end
end
return n
"""

# ARGV: call id, memo ttl ms, hexes...  Removes each subtree deepest first, skipping held nodes
# (and so their ancestors).  A resend of the call returns the first run's result (recalled).
_EVICT_KEYS = r"""
need_store()
local done = recalled(ARGV[1])
if done then return done end
reap(now_ms())
local roots = {}
for i = 3, #ARGV do roots[#roots + 1] = ARGV[i] end
local order = subtree(roots)
for _, h in ipairs(order) do  -- a retained entry (or an ancestor of one) in there: nothing goes
  if tonumber(redis.call('HGET', E(h), 'ra') or '0') > 0 then return {'retained', h} end
end
local n, b, skipped = 0, 0, 0
for i = #order, 1, -1 do
  local h = order[i]
  local v = redis.call('HMGET', E(h), 'ch', 'lc', 'fc', 'xc')
  if v[1] then
    if tonumber(v[1]) > 0 or tonumber(v[2]) > 0 or tonumber(v[3]) > 0 or tonumber(v[4] or '0') > 0 then
      skipped = skipped + 1
    else
      b = b + remove_entry(h)
      n = n + 1
    end
  end
end
mincr('evictions', n)
mincr('evicted_bytes', b)
return remember(ARGV[1], ARGV[2], n, b, skipped)
"""

# ARGV: call id, memo ttl ms, nbytes.  Evicts LRU leaves until nbytes are freed or nothing
# evictable is left.  A resend of the call returns the first run's result and evicts no more.
_EVICT_BYTES = r"""
need_store()
local done = recalled(ARGV[1])
if done then return done end
reap(now_ms())
local victims = plan(tonumber(ARGV[3]), nil, true)
local n, b = evict_all(victims)
return remember(ARGV[1], ARGV[2], n, b, 0)
"""

# ARGV: h, name, blob
_PUT_ANCHOR = r"""
need_store()
reap(now_ms())
local h, name, blob = ARGV[1], ARGV[2], ARGV[3]
if redis.call('EXISTS', E(h)) == 0 then return 'noentry' end
local had = redis.call('HEXISTS', A(h), name) == 1
local delta = #blob - redis.call('HSTRLEN', A(h), name)
if delta > 0 and not make_room(delta, h) then
  return 'cap ' .. mget('budget') .. ' ' .. mget('used') .. ' ' .. mget('sealed')
end
redis.call('HSET', A(h), name, blob)
redis.call('HINCRBY', E(h), 'c', delta)
mincr('used', delta)
mincr('sealed', delta)
if not had then
  redis.call('HINCRBY', E(h), 'na', 1)
  mincr('anchors', 1)
end
return 'ok'
"""

# ARGV: h -> {name1, len1, ...}
_LIST_ANCHORS = r"""
local out = {}
for _, name in ipairs(redis.call('HKEYS', A(ARGV[1]))) do
  out[#out + 1] = name
  out[#out + 1] = redis.call('HSTRLEN', A(ARGV[1]), name)
end
return out
"""

# ARGV: name, hexes... -> i+1 of the deepest stored-prefix page carrying the anchor
_DEEPEST_ANCHOR = r"""
local name, best = ARGV[1], 0
for i = 2, #ARGV do
  if redis.call('EXISTS', E(ARGV[i])) == 0 then break end
  if redis.call('HEXISTS', A(ARGV[i]), name) == 1 then best = i - 1 end
end
return best
"""

# ARGV: hexes... -> per key {p, n, g, k, ct, lu, r, names-and-lengths...} or {} when absent
_INFO = r"""
local out = {}
for i = 1, #ARGV do
  local h = ARGV[i]
  local v = redis.call('HMGET', E(h), 'p', 'n', 'g', 'k', 'ct', 'lu', 'r', 'xp', 'rt')
  if v[2] then
    if v[1] == '' and v[8] then v[1] = v[8] end  -- the parent in another shard (sharded stores)
    v[8] = v[9] or '0'  -- retained
    v[9] = nil
    for _, name in ipairs(redis.call('HKEYS', A(h))) do
      v[#v + 1] = name
      v[#v + 1] = redis.call('HSTRLEN', A(h), name)
    end
    out[i] = v
  else
    out[i] = {}
  end
end
return out
"""

# ARGV: h -> 1 if a live (unexpired) reservation holds it
_IN_FLIGHT = r"""
need_store()
reap(now_ms())
return redis.call('EXISTS', F(ARGV[1]))
"""

# ARGV: group, hexes... -> per key -1 (not stored here) or its depth inside its placement group
# (the sharded cluster store: a group's first page is a local root, so this walks at most
# ``group`` parent links).  Lets a client place the child of a page it has not seen in a chain.
_LOCATE = r"""
local g = tonumber(ARGV[1])
local out = {}
for i = 2, #ARGV do
  local h = ARGV[i]
  local d = -1
  local p = redis.call('HGET', E(h), 'p')
  if p then
    d = 0
    while p ~= '' and d < g do
      d = d + 1
      p = redis.call('HGET', E(p), 'p') or ''
    end
  end
  out[#out + 1] = d
end
return out
"""

# -- cross-shard pins (sharded stores) ------------------------------------------------------
# A group-first page in shard B whose parent P lives in shard A holds a *pin* on P: a member
# ``<B>:<child hex>:<nonce>`` of the hash x:<P> in A (value: ms when pinned), counted in P's
# field xc, which makes P a non-leaf here (never LRU-evicted, skipped by evict_keys).  The pin is
# placed *before* the child is published (so a child never exists unpinned, except after a
# client crash between the two steps of put_many's in-call parents, see _XPIN) and released
# after the child is gone (via B's outbox, drained by clients: a crash in between leaves P
# pinned longer, the safe side; verify(repair=True) reconciles).

# ARGV: strict 0/1, then pairs (parent hex, pin).  Per pair '1' (pinned) or '0' (strict and the
# parent is not sealed here: the child's write must fail).  Non-strict pins a parent that is not
# stored yet (an earlier item of the same put_many, published in parallel): the seal or put that
# creates it counts the pins already there.  Idempotent per pin.
_XPIN = r"""
local strict, now = ARGV[1] == '1', now_ms()
local out = {}
for i = 2, #ARGV, 2 do
  local p, m = ARGV[i], ARGV[i + 1]
  local here = redis.call('EXISTS', E(p)) == 1
  if strict and not here then
    out[#out + 1] = '0'
  else
    if redis.call('HSET', X(p), m, now) == 1 then
      -- XZ: pinned pages by their LRU tick (0 until the page is created; seal/put set it)
      redis.call('ZADD', XZ, 'NX', tonumber(redis.call('HGET', E(p), 't') or '0'), p)
      if here then
        redis.call('HINCRBY', E(p), 'xc', 1)
        redis.call('ZREM', LRU, p)
      end
    end
    out[#out + 1] = '1'
  end
end
return table.concat(out)
"""

# ARGV: pairs (parent hex, pin).  Releases the pins (idempotent); a parent left with no pin and
# nothing else holding it becomes an LRU leaf again.
_XUNPIN = r"""
local n = 0
for i = 1, #ARGV, 2 do
  local p, m = ARGV[i], ARGV[i + 1]
  if redis.call('HDEL', X(p), m) == 1 then
    n = n + 1
    if redis.call('EXISTS', X(p)) == 0 then redis.call('ZREM', XZ, p) end
    if redis.call('EXISTS', E(p)) == 1 then
      redis.call('HINCRBY', E(p), 'xc', -1)
      maybe_leaf(p)
    end
  end
end
return n
"""

# ARGV: n -> the pins on the (up to) n least recently used pinned pages of this shard: the child
# groups to evict when this shard is full of pages that only their pins hold (per-shard budget).
_XHOT = r"""
local out = {}
for _, p in ipairs(redis.call('ZRANGE', XZ, 0, tonumber(ARGV[1]) - 1)) do
  for _, m in ipairs(redis.call('HKEYS', X(p))) do out[#out + 1] = m end
end
return out
"""

# ARGV: max [, min age ms] -> the first `max` outbox entries ("<parent shard> <parent hex> <pin>"),
# then the first `max` drop-outbox entries at least `min age` old, each as "d <ms> <pin>".  The
# age lets the renewal thread leave a fresh drop to the client that made it (which carries it
# out at once and counts what it removed) and take only those a dead client left behind.
_XOUT = r"""
local max = tonumber(ARGV[1])
local out = redis.call('LRANGE', XO, 0, max - 1)
local upto = now_ms() - tonumber(ARGV[2] or '0')
for _, x in ipairs(redis.call('LRANGE', XD, 0, max - 1)) do
  if tonumber(string.match(x, '^%d+')) > upto then break end  -- (pushed in time order)
  out[#out + 1] = 'd ' .. x
end
return out
"""

# ARGV: entries (as xout gave them)... -> removes each (once) from its outbox, after it was applied.
_XACK = r"""
for i = 1, #ARGV do
  local x = ARGV[i]
  if string.sub(x, 1, 2) == 'd ' then
    redis.call('LREM', XD, 1, string.sub(x, 3))
  else
    redis.call('LREM', XO, 1, x)
  end
end
return #ARGV
"""

# ARGV: pairs (child hex, pin) -> entries removed.  The cascade of a forced drop (see remove_entry):
# each child group here that holds exactly that pin on its dropped parent goes with its whole
# subtree, by force as the drop itself (leased or retained pages too), deepest first; a live
# reservation holding the pin is cancelled (its seal would publish a page under a dropped parent).
# A key sealed again since holds another pin and stays.  Idempotent.
_XDROP = r"""
local n = 0
for i = 1, #ARGV, 2 do
  local h, m = ARGV[i], ARGV[i + 1]
  if redis.call('HGET', E(h), 'xm') == m then
    local order = subtree({h})
    for j = #order, 1, -1 do remove_entry(order[j]) end
    n = n + #order
  elseif redis.call('HGET', F(h), 'xm') == m then
    cancel_flight(h)
  end
end
return n
"""

# ARGV: hexes... -> the pins held on every page of their subtrees here: the child groups in
# other shards (evict(keys) follows them there, deepest first).
_XSUB = r"""
local roots = {}
for i = 1, #ARGV do roots[i] = ARGV[i] end
local out = {}
for _, h in ipairs(subtree(roots)) do
  for _, m in ipairs(redis.call('HKEYS', X(h))) do out[#out + 1] = m end
end
return out
"""

# ARGV: -> {server ms now, then parent hex, pin, pinned ms, ...} of every pin in this shard
# (verify's reconciliation; one SCAN of the node, so not for a hot path).
_XLIST = r"""
local out, cur = {tostring(now_ms())}, '0'
repeat
  local r = redis.call('SCAN', cur, 'MATCH', P .. 'x:*', 'COUNT', 1000)
  cur = r[1]
  for _, name in ipairs(r[2]) do
    local p = string.sub(name, #P + 3)
    local kv = redis.call('HGETALL', name)
    for j = 1, #kv, 2 do
      out[#out + 1] = p
      out[#out + 1] = kv[j]
      out[#out + 1] = kv[j + 1]
    end
  end
until cur == '0'
return out
"""

# ARGV: pairs (child hex, pin) -> per pair '1' if a sealed entry or a live reservation of that
# key here holds exactly that pin, else '0'.
_XHELD = r"""
local out = {}
for i = 1, #ARGV, 2 do
  local h, m = ARGV[i], ARGV[i + 1]
  local held = redis.call('HGET', E(h), 'xm') == m or redis.call('HGET', F(h), 'xm') == m
  out[#out + 1] = held and '1' or '0'
end
return table.concat(out)
"""

# ARGV: mode, share, hexes...  Retained prefixes (SupportsRetain).  Modes:
#   mark   -- mark sealed entries retained, all or nothing: {'missing', h} when one is not stored,
#             {'cap', retained_bytes, adding, cap} when the marks with the ancestors they add would
#             exceed share * budget; else {'ok', newly marked, remote...}
#   unmark -- clear marks (unmarked or absent keys ignored): {'ok', cleared, remote...}
#   up / down -- (sharded stores) a child group in another shard gained / lost its retained
#             count: adjust the refcount of these parents, no cap check: {'ok', 0, remote...}
# `remote`: "<shard> <parent hex>" of the parents in other shards the change goes on to.
_RETAIN = r"""
need_store()
local mode, share = ARGV[1], tonumber(ARGV[2])
local remote = {}
if mode == 'mark' then
  local todo, seen, add = {}, {}, 0
  for i = 3, #ARGV do
    local h = ARGV[i]
    local v = redis.call('HMGET', E(h), 'rt', 'c')
    if not v[2] then return {'missing', h} end
    if v[1] ~= '1' and not seen[h] then
      todo[#todo + 1] = h
      -- the bytes this mark adds: h and its ancestors up to the first one already counted
      local x = h
      while x and x ~= '' and not seen[x] do
        local w = redis.call('HMGET', E(x), 'ra', 'c', 'p')
        if not w[2] or tonumber(w[1] or '0') > 0 then break end
        seen[x] = true
        add = add + tonumber(w[2])
        x = w[3]
      end
      seen[h] = true
    end
  end
  local cap = math.floor(share * mget('budget'))
  if mget('retained_bytes') + add > cap then
    return {'cap', tostring(mget('retained_bytes')), tostring(add), tostring(cap)}
  end
  for _, h in ipairs(todo) do
    redis.call('HSET', E(h), 'rt', 1)
    redis.call('ZREM', LRU, h)
    ra_walk(h, 1, remote)
  end
  mincr('retained', #todo)
  return {'ok', #todo, unpack(remote)}
end
local n = 0
for i = 3, #ARGV do
  local h = ARGV[i]
  if redis.call('EXISTS', E(h)) == 1 then
    if mode == 'unmark' then
      if redis.call('HGET', E(h), 'rt') == '1' then
        redis.call('HDEL', E(h), 'rt')
        ra_walk(h, -1, remote)
        maybe_leaf(h)
        n = n + 1
      end
    elseif mode == 'up' then
      ra_walk(h, 1, remote)
    elseif mode == 'down' then
      ra_walk(h, -1, remote)
    end
  end
end
if mode == 'unmark' then mincr('retained', -n) end
return {'ok', n, unpack(remote)}
"""

# ARGV: hexes... -> the first key in their subtrees (here) that is retained or an ancestor of a
# retained entry, or '' (the sharded store checks every level before it evicts any).
_RETAINED_IN = r"""
local roots = {}
for i = 1, #ARGV do roots[i] = ARGV[i] end
for _, h in ipairs(subtree(roots)) do
  if tonumber(redis.call('HGET', E(h), 'ra') or '0') > 0 then return h end
end
return ''
"""

_BODIES = {
    "init": _INIT,
    "reserve": _RESERVE,
    "seal": _SEAL,
    "abort": _ABORT,
    "probe": _PROBE,
    "put": _PUT,
    "lease": _LEASE,
    "release": _RELEASE,
    "renew": _RENEW,
    "present": _PRESENT,
    "prefix": _PREFIX,
    "touch": _TOUCH,
    "drop": _DROP,
    "drop_orphan": _DROP_ORPHAN,
    "evict_keys": _EVICT_KEYS,
    "evict_bytes": _EVICT_BYTES,
    "put_anchor": _PUT_ANCHOR,
    "list_anchors": _LIST_ANCHORS,
    "deepest_anchor": _DEEPEST_ANCHOR,
    "info": _INFO,
    "in_flight": _IN_FLIGHT,
    "locate": _LOCATE,
    "xpin": _XPIN,
    "xunpin": _XUNPIN,
    "xout": _XOUT,
    "xack": _XACK,
    "xsub": _XSUB,
    "xlist": _XLIST,
    "xheld": _XHELD,
    "xhot": _XHOT,
    "xdrop": _XDROP,
    "links": _LINKS,
    "lru_head": _LRU_HEAD,
    "retain": _RETAIN,
    "retained_in": _RETAINED_IN,
}

#: name -> full Lua source (prelude + body); loaded with SCRIPT LOAD, called with EVALSHA.
SCRIPTS: dict[str, str] = {name: _PRELUDE + body for name, body in _BODIES.items()}
