"""Throw-away ``redis-server`` processes on loopback, for tests and benchmarks.

Every server binds 127.0.0.1 only, persists nothing (``--save "" --appendonly no``), keeps its
files in a directory the caller owns, and is killed by :meth:`stop` (or the ``with`` block).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import redis
from hostkv_providers.errors import StorageIOError

__all__ = ["RedisClusterServers", "RedisServer", "TLSFiles", "free_port", "make_tls_files", "server_binary",
           "server_has_tls", "server_version"]


def server_binary() -> str | None:
    """The server binary the helpers start: ``$HOSTKV_REDIS_SERVER`` when set (e.g. a
    ``valkey-server``), else ``redis-server`` or ``valkey-server`` on the PATH; ``None`` when
    there is none."""
    chosen = os.environ.get("HOSTKV_REDIS_SERVER")
    if chosen:
        return shutil.which(chosen)
    return shutil.which("redis-server") or shutil.which("valkey-server")


def server_version() -> str:
    """``redis-server --version`` of the binary the helpers start (``"none"`` if missing)."""
    binary = server_binary()
    if binary is None:
        return "none"
    return subprocess.run([binary, "--version"], capture_output=True, text=True, check=False).stdout.strip()


def server_has_tls() -> bool:
    """Whether the ``redis-server`` the helpers start was built with TLS (Debian's is)."""
    binary = server_binary()
    if binary is None:
        return False
    # Ask for a TLS port without a certificate: a build with TLS exits complaining about the
    # missing tls-cert-file; one without exits earlier (an unknown directive in Redis 7.0, "Failed
    # finding TLS support" where TLS is an optional module, as in Valkey and Redis >= 7.2).
    try:
        out = subprocess.run([binary, "--port", "0", "--tls-port", str(free_port()), "--bind", "127.0.0.1",
                              "--save", "", "--appendonly", "no", "--daemonize", "no",
                              "--dir", tempfile.gettempdir()],
                             capture_output=True, text=True, check=False, timeout=30)
    except subprocess.TimeoutExpired:  # it started anyway (and was killed): no certificate check
        return False
    return "tls-cert-file" in out.stdout + out.stderr


@dataclass(frozen=True)
class TLSFiles:
    """A throw-away certificate authority and a server certificate it signed (PEM files)."""

    ca_cert: Path
    cert: Path
    key: Path


def make_tls_files(directory: Path | str, *, openssl: str = "openssl") -> TLSFiles:
    """Create a CA and a server certificate for ``127.0.0.1``/``localhost`` with the ``openssl``
    CLI, valid for two days (tests only: the keys are unencrypted, mode 0600)."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    ca_key, ca_cert, key, csr, cert, ext = (d / n for n in ("ca.key", "ca.crt", "server.key", "server.csr",
                                                             "server.crt", "server.ext"))
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=critical,CA:FALSE\n"
                   "keyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    steps = [
        [openssl, "req", "-x509", *ec, "-keyout", str(ca_key), "-out", str(ca_cert), "-days", "2",
         "-subj", "/CN=hostkv-redis test CA", "-addext", "basicConstraints=critical,CA:TRUE",
         "-addext", "keyUsage=critical,keyCertSign,cRLSign"],
        [openssl, "req", *ec, "-keyout", str(key), "-out", str(csr), "-subj", "/CN=localhost"],
        [openssl, "x509", "-req", "-in", str(csr), "-CA", str(ca_cert), "-CAkey", str(ca_key),
         "-CAcreateserial", "-out", str(cert), "-days", "2", "-extfile", str(ext)],
    ]
    for cmd in steps:
        out = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=60)
        if out.returncode != 0:
            raise StorageIOError(f"{' '.join(cmd[:2])} failed: {out.stderr.strip()[-500:]}")
    for f in (ca_key, key):
        f.chmod(0o600)
    return TLSFiles(ca_cert, cert, key)


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(cluster_bus: bool = False) -> int:
    """A loopback port that is free now (and port + 10000 too, for a cluster bus)."""
    for _ in range(200):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port > 55000 and cluster_bus:
            continue
        if not cluster_bus or _port_free(port + 10000):
            return port
    raise StorageIOError("no free loopback port found")


class RedisServer:
    """One ``redis-server`` on 127.0.0.1 in ``workdir``; ``restart()`` keeps its port.

    With ``tls``, it listens only on a TLS port (``--port 0 --tls-port``) with that certificate,
    without asking clients for theirs; ``url`` is then a ``rediss://`` URL that trusts the CA.
    """

    def __init__(self, workdir: Path | str, *, port: int | None = None, extra_args: tuple[str, ...] = (),
                 tls: TLSFiles | None = None) -> None:
        binary = server_binary()
        if binary is None:
            raise FileNotFoundError("redis-server is not installed (apt-get install redis-server)")
        self.binary = binary
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = port if port is not None else free_port()
        self.extra_args = extra_args
        self.tls = tls
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        if self.tls is None:
            return f"redis://127.0.0.1:{self.port}/0"
        return f"rediss://127.0.0.1:{self.port}/0?" + urllib.parse.urlencode({"ssl_ca_certs": str(self.tls.ca_cert)})

    def start(self, timeout: float = 20.0) -> RedisServer:
        if self.tls is None:
            listen = ["--port", str(self.port)]
        else:
            listen = ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", str(self.tls.cert),
                      "--tls-key-file", str(self.tls.key), "--tls-ca-cert-file", str(self.tls.ca_cert),
                      "--tls-auth-clients", "no"]
        args = [self.binary, *listen, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", str(self.workdir), "--daemonize", "no", "--protected-mode", "yes",
                "--logfile", str(self.workdir / f"redis-{self.port}.log"), *self.extra_args]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while True:
            try:
                with self.client(socket_connect_timeout=0.5) as c:
                    c.ping()
                return self
            except redis.exceptions.RedisError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    log = self.workdir / f"redis-{self.port}.log"
                    tail = log.read_text()[-2000:] if log.exists() else ""
                    self.stop()
                    raise StorageIOError(f"redis-server on port {self.port} did not start: {tail}") from None
                time.sleep(0.05)

    def stop(self) -> None:
        """Kill the server (SIGKILL: a crash, not a clean shutdown) and reap it."""
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait(timeout=10)
            self.proc = None

    def restart(self) -> None:
        """Kill and start again on the same port; with ``--save ""`` it comes back empty."""
        self.stop()
        self.start()

    def client(self, **kwargs: Any) -> redis.Redis:
        """A plain redis-py client of this server (over TLS when it has ``tls``)."""
        if self.tls is not None:
            kwargs.update(ssl=True, ssl_ca_certs=str(self.tls.ca_cert))
        return redis.Redis(host="127.0.0.1", port=self.port, **kwargs)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


def _info_field(text: str, name: str) -> str:
    """One ``name:value`` field of a ``CLUSTER INFO`` reply (``""`` when absent)."""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key == name:
            return value.strip()
    return ""


class RedisClusterServers:
    """A Redis Cluster of ``masters`` masters, each with ``replicas`` replicas, on loopback ports.

    ``servers[:masters]`` start as the masters (slots split into equal contiguous ranges),
    ``servers[masters:]`` as their replicas (replica ``j`` of master ``i`` is
    ``servers[masters + i * replicas + j]``).  After a failover the roles move: ask
    :meth:`masters_now`.
    """

    def __init__(self, workdir: Path | str, masters: int = 3, replicas: int = 0,
                 node_timeout_ms: int = 2000) -> None:
        self.workdir = Path(workdir)
        self.masters = masters
        self.replicas = replicas
        self.servers: list[RedisServer] = []
        for i in range(masters * (1 + replicas)):
            port = free_port(cluster_bus=True)
            while any(s.port == port for s in self.servers):
                port = free_port(cluster_bus=True)
            d = self.workdir / f"node{i}"
            self.servers.append(RedisServer(d, port=port, extra_args=(
                "--cluster-enabled", "yes", "--cluster-config-file", str(d / "nodes.conf"),
                "--cluster-node-timeout", str(node_timeout_ms))))

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.servers[0].port}"

    def start(self, timeout: float = 30.0) -> RedisClusterServers:
        try:
            for s in self.servers:
                s.start()
            self._create()
            deadline = time.monotonic() + timeout
            while not self._ok():
                if time.monotonic() > deadline:
                    raise StorageIOError("the redis cluster did not reach cluster_state:ok")
                time.sleep(0.1)
        except BaseException:
            self.stop()
            raise
        return self

    def _create(self) -> None:
        # Assign slots directly (CLUSTER ADDSLOTSRANGE + MEET): no redis-cli needed, and it is
        # deterministic; redis-cli --cluster create does the same plus interactive checks.
        n = self.masters
        per = 16384 // n
        # Distinct config epochs before MEET, as redis-cli --cluster create sets them. Left at 0,
        # the nodes resolve the collision by gossip, one bump at a time; a slot migrated before
        # that settles can go back to its old master on the strength of a higher epoch, and the
        # new master then deletes the keys it was given (a test's store read back empty, once, in
        # CI on a loaded 2-core machine).
        for i, s in enumerate(self.servers):
            with s.client() as c:
                c.execute_command("CLUSTER", "SET-CONFIG-EPOCH", i + 1)
        for i, s in enumerate(self.servers[:n]):
            lo = i * per
            hi = 16383 if i == n - 1 else (i + 1) * per - 1
            with s.client() as c:
                c.execute_command("CLUSTER", "ADDSLOTSRANGE", lo, hi)
        with self.servers[0].client() as c:
            for s in self.servers[1:]:
                c.execute_command("CLUSTER", "MEET", "127.0.0.1", s.port)
        if not self.replicas:
            return
        ids = [self.node_id(s) for s in self.servers[:n]]
        deadline = time.monotonic() + 30
        for i in range(n):
            for j in range(self.replicas):
                replica = self.servers[n + i * self.replicas + j]
                while True:  # the replica must have learnt its master's id through MEET first
                    try:
                        with replica.client() as c:
                            c.execute_command("CLUSTER", "REPLICATE", ids[i])
                        break
                    except redis.exceptions.ResponseError:
                        if time.monotonic() > deadline:
                            raise
                        time.sleep(0.1)

    @staticmethod
    def node_id(server: RedisServer) -> str:
        with server.client() as c:
            out = c.execute_command("CLUSTER", "MYID")
        return out.decode() if isinstance(out, bytes) else str(out)

    def _ok(self) -> bool:
        epochs: set[str] = set()
        for s in self.servers:
            if s.proc is None:
                continue
            try:
                with s.client(socket_timeout=2) as c:
                    info = c.execute_command("CLUSTER", "INFO")
                    if self.replicas and s in self.servers[self.masters:]:
                        repl = c.info("replication")
                        if repl.get("role") == "slave" and repl.get("master_link_status") != "up":
                            return False
            except redis.exceptions.RedisError:
                return False
            text = info.decode() if isinstance(info, bytes) else str(info)
            if "cluster_state:ok" not in text or f"cluster_known_nodes:{len(self.servers)}" not in text:
                return False
            epochs.add(_info_field(text, "cluster_current_epoch"))
        # every node has heard of every epoch: a first slot migration then bumps past all of them
        return len(epochs) == 1

    def wait_ok(self, timeout: float = 30.0) -> None:
        """Wait until every running node reports ``cluster_state:ok`` (e.g. after a failover)."""
        deadline = time.monotonic() + timeout
        while not self._ok_running():
            if time.monotonic() > deadline:
                raise StorageIOError("the redis cluster did not return to cluster_state:ok")
            time.sleep(0.1)

    def _ok_running(self) -> bool:
        for s in self.servers:
            if s.proc is None:
                continue
            try:
                with s.client(socket_timeout=2) as c:
                    info = c.execute_command("CLUSTER", "INFO")
            except redis.exceptions.RedisError:
                return False
            text = info.decode() if isinstance(info, bytes) else str(info)
            if "cluster_state:ok" not in text:
                return False
        return True

    def masters_now(self) -> list[RedisServer]:
        """The running nodes that are masters owning slots now (roles move on failover)."""
        out = []
        for s in self.servers:
            if s.proc is None:
                continue
            try:
                with s.client(socket_timeout=2) as c:
                    if c.info("replication").get("role") == "master" and self._owns_slots(c):
                        out.append(s)
            except redis.exceptions.RedisError:
                continue
        return out

    @staticmethod
    def _owns_slots(c: redis.Redis) -> bool:
        raw = c.execute_command("CLUSTER", "NODES")  # type: ignore[no-untyped-call]
        text = raw.decode() if isinstance(raw, bytes) else str(raw)
        for line in text.splitlines():
            parts = line.split()
            if len(parts) > 2 and "myself" in parts[2]:
                return len(parts) > 8
        return False

    def replica_of(self, master: RedisServer) -> RedisServer | None:
        """A running replica of ``master`` (by the replicas' own view of their master)."""
        for s in self.servers:
            if s is master or s.proc is None:
                continue
            try:
                with s.client(socket_timeout=2) as c:
                    repl = c.info("replication")
            except redis.exceptions.RedisError:
                continue
            if repl.get("role") == "slave" and int(repl.get("master_port", -1)) == master.port:
                return s
        return None

    def stop(self) -> None:
        for s in self.servers:
            s.stop()

    def __enter__(self) -> RedisClusterServers:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
