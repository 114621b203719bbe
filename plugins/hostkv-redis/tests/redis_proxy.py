"""A TCP proxy in front of a real redis-server, for tests of what a client does when the network
or the server misbehaves: it can lose the replies of a command (the connection is cut after the
server ran it), hold a command until the test lets it go, refuse connections, or answer a
command with bytes of its own (a malformed reply, or one that never ends).

Commands are recognised by a byte string in what the client sent (a script's SHA-1, ``GET``),
matched once: the first command that carries it is the one affected, later ones pass.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable


class Proxy:
    def __init__(self, port: int) -> None:
        self.target = port
        self.lsock = socket.socket()
        self.lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.lsock.bind(("127.0.0.1", 0))
        self.lsock.listen(64)
        self.port: int = self.lsock.getsockname()[1]
        self.lock = threading.Lock()
        self.cut_on: bytes | None = None  # lose the replies of the command carrying this
        self.garbage_on: bytes | None = None  # answer the command carrying this with `garbage`
        # bytes sent instead of the server's reply, or a function that writes to the client's socket
        self.garbage: bytes | Callable[[socket.socket], None] = b""
        self.refuse = False  # close new connections at once
        self.refuse_after_cut = False  # a cut takes the server away for good
        self.cuts = 0
        self.hold_on: bytes | None = None  # delay the command carrying this until `release`
        self.split_on: bytes | None = None  # send what comes before this, hold the rest until `release`
        self.held = threading.Event()
        self.release = threading.Event()
        self.closed = False
        self.socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _take(self, name: str, window: bytes) -> bool:
        """Whether ``window`` carries the pattern in attribute ``name`` (then it is cleared)."""
        with self.lock:
            pattern = getattr(self, name)
            if pattern is None or pattern not in window:
                return False
            setattr(self, name, None)
            return True

    def _accept(self) -> None:
        while not self.closed:
            try:
                c, _ = self.lsock.accept()
            except OSError:
                return
            if self.refuse:
                c.close()
                continue
            s = socket.create_connection(("127.0.0.1", self.target))
            self.socks += [c, s]
            state = {"cut": False}
            threading.Thread(target=self._up, args=(c, s, state), daemon=True).start()
            threading.Thread(target=self._down, args=(c, s, state), daemon=True).start()

    def _up(self, c: socket.socket, s: socket.socket, state: dict[str, bool]) -> None:
        window = b""
        try:
            while True:
                data = c.recv(1 << 20)
                if not data:
                    break
                window = window[-256:] + data
                with self.lock:
                    at = -1 if self.split_on is None else data.find(self.split_on)
                    if at >= 0:
                        self.split_on = None
                if at >= 0:  # the commands before it run now, the rest when the test lets them
                    s.sendall(data[:at])
                    data = data[at:]
                    self.held.set()
                    self.release.wait(10)
                garbage = self._take("garbage_on", window)
                cut = self._take("cut_on", window)
                if self._take("hold_on", window):  # the command waits here until the test lets it go
                    self.held.set()
                    self.release.wait(10)
                if garbage:
                    state["cut"] = True  # the server's replies (if any) are not forwarded
                    if callable(self.garbage):
                        threading.Thread(target=self.garbage, args=(c,), daemon=True).start()
                    else:
                        c.sendall(self.garbage)
                    continue
                if cut:
                    # before the command goes on: its reply must not slip through to the client
                    state["cut"] = True
                    self.cuts += 1
                    if self.refuse_after_cut:
                        self.refuse = True
                    threading.Thread(target=self._cut_later, args=(c, s), daemon=True).start()
                s.sendall(data)
        except OSError:
            pass

    @staticmethod
    def _cut_later(c: socket.socket, s: socket.socket) -> None:
        time.sleep(0.5)  # the server has run the command by then
        for x in (c, s):
            with contextlib.suppress(OSError):
                x.shutdown(socket.SHUT_RDWR)
            x.close()

    def _down(self, c: socket.socket, s: socket.socket, state: dict[str, bool]) -> None:
        try:
            while True:
                data = s.recv(1 << 20)
                if not data:
                    break
                if not state["cut"]:
                    c.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                c.close()

    def close(self) -> None:
        self.closed = True
        self.release.set()
        self.lsock.close()
        for x in self.socks:
            with contextlib.suppress(OSError):
                x.close()
