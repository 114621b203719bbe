"""``rediss://`` for real: a throw-away CA and server certificate (``openssl`` CLI), a
``redis-server`` listening on a TLS port only, and the provider over it (URL options, failures
that must be typed, the batch paths that read and write the socket directly, and the
conformance suite)."""

from __future__ import annotations

import shutil
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import hostkv_providers
import pytest
from hostkv_providers import InvalidArgumentError, Provider, StorageIOError
from hostkv_providers.testing import ProviderTests, chain, page_bytes
from redis.connection import SSLConnection
from test_conformance import _RedisBackdoors

from hostkv_redis import RedissProvider
from hostkv_redis.servers import RedisServer, TLSFiles, make_tls_files, server_binary, server_has_tls

pytestmark = [
    pytest.mark.skipif(shutil.which("openssl") is None, reason="the openssl CLI is not installed"),
    pytest.mark.skipif(server_binary() is not None and not server_has_tls(),
                       reason="the server binary has no TLS support (built without it, or TLS is a module not loaded)"),
]


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> TLSFiles:
    return make_tls_files(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory, tls_files: TLSFiles) -> Iterator[RedisServer]:
    with RedisServer(tmp_path_factory.mktemp("redis-tls"), tls=tls_files) as server:
        yield server


def _url(server: RedisServer, **options: str) -> str:
    return f"rediss://127.0.0.1:{server.port}/0?" + urllib.parse.urlencode(options)


def test_rediss_url_round_trip(tls_server: RedisServer, tls_files: TLSFiles) -> None:
    url = _url(tls_server, ssl_ca_certs=str(tls_files.ca_cert), namespace="tls-rt", budget="64MiB")
    with hostkv_providers.open(url) as p:
        assert isinstance(p, RedissProvider)
        assert p._link.client().connection_pool.connection_class is SSLConnection
        keys = chain("tls", 6)
        big = 1 << 20  # several TLS records per page: the direct socket reads must reassemble them
        assert p.put_many([(k, keys[i - 1] if i else None, page_bytes(k, big)) for i, k in enumerate(keys)]) == [
            True] * 6
        assert p.longest_prefix(keys) == 6
        outs = [bytearray(big) for _ in keys]
        with p.lease(keys) as lease:
            assert lease.prefix_len == 6
            assert p.read_many(keys, outs) == [True] * 6
        assert all(bytes(o) == page_bytes(k, big) for o, k in zip(outs, keys, strict=True))
        extra = chain("tls-single", 1)[0]
        assert p.put(extra, keys[-1], page_bytes(extra, 4096))  # reserve / write / seal
        assert p.read_bytes(extra) == page_bytes(extra, 4096)
        assert p.describe()["url"].startswith("rediss://")
    with tls_server.client() as c:  # the server saw it, over TLS
        assert c.hget("hkv:{tls-rt}:m", "entries") == b"7"


def test_rediss_without_verification(tls_server: RedisServer) -> None:
    url = _url(tls_server, ssl_cert_reqs="none", ssl_check_hostname="false", namespace="tls-noverify")
    with hostkv_providers.open(url) as p:
        k = chain("tls-nv", 1)[0]
        assert p.put(k, None, page_bytes(k, 4096))
        assert p.read_bytes(k) == page_bytes(k, 4096)


def test_rediss_failures_are_typed(tls_server: RedisServer, tls_files: TLSFiles, tmp_path: Path) -> None:
    # the server's certificate is not signed by the default CAs
    with pytest.raises(StorageIOError):
        hostkv_providers.open(_url(tls_server, namespace="tls-bad", timeout="2", retries="0"))
    # a CA that did not sign it
    other = make_tls_files(tmp_path / "other")
    with pytest.raises(StorageIOError):
        hostkv_providers.open(_url(tls_server, ssl_ca_certs=str(other.ca_cert), namespace="tls-bad",
                                   timeout="2", retries="0"))
    # plain TCP to a TLS-only port
    with pytest.raises(StorageIOError):
        hostkv_providers.open(f"redis://127.0.0.1:{tls_server.port}/0?namespace=tls-bad&timeout=2&retries=0")
    # TLS options on a plain URL, and bad values
    with pytest.raises(InvalidArgumentError, match="TLS options"):
        hostkv_providers.open(f"redis://127.0.0.1:{tls_server.port}/0?ssl_ca_certs={tls_files.ca_cert}")
    with pytest.raises(InvalidArgumentError):
        hostkv_providers.open(_url(tls_server, ssl_cert_reqs="sometimes"))


class TestRedissConformance(_RedisBackdoors, ProviderTests):
    """The conformance suite over ``rediss://`` (lighter thread and stateful runs, like the
    cluster's: the TLS code path is the connection, not the logic)."""

    supports_reopen = True
    thread_ops: ClassVar[int] = 40
    stateful_examples: ClassVar[int] = 5

    @pytest.fixture(autouse=True)
    def _bind_tls(self, tls_server: RedisServer) -> Iterator[None]:
        self.server = tls_server
        self.namespaces, self.corrupted = [], False
        yield
        with tls_server.client() as client:
            self._check_stores(client)

    def make_provider(self, tmp_path: Path, budget_bytes: int) -> Provider:
        return RedissProvider(self.server.url, budget_bytes=budget_bytes, namespace=self._fresh_namespace("s"))

    def reopen(self, provider: Provider) -> Provider:
        assert isinstance(provider, RedissProvider)
        provider.close()
        return RedissProvider(self.server.url, namespace=provider.namespace)
