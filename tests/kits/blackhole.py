"""A TCP server that accepts connections and never answers (a wedged broker).

The fault issue 10 item 4 describes: a broker or Redis whose port is open (a
half-dead process, a stuck proxy, a full accept queue behind a load balancer)
but that never replies. ``BlackHole`` listens on 127.0.0.1, accepts every
connection, reads and discards what arrives, and writes nothing back; it keeps
each socket open until it is closed. Real sockets, real kernel: no mock.
"""

from __future__ import annotations

import selectors
import socket
import threading
from types import TracebackType


class BlackHole:
    """``with BlackHole() as hole: ... hole.url("redis")`` (redis://127.0.0.1:<port>/0)."""

    def __init__(self) -> None:
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(128)
        self._listener.setblocking(False)
        self.port: int = self._listener.getsockname()[1]
        self.accepted = 0
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="blackhole", daemon=True)

    def url(self, scheme: str = "redis") -> str:
        suffix = "/0" if scheme.startswith("redis") else "//"
        return f"{scheme}://127.0.0.1:{self.port}{suffix}"

    def _run(self) -> None:
        while not self._stop.is_set():
            for key, _ in self._selector.select(timeout=0.1):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                if sock is self._listener:
                    try:
                        conn, _ = sock.accept()
                    except OSError:
                        continue
                    conn.setblocking(False)
                    self.accepted += 1
                    self._selector.register(conn, selectors.EVENT_READ)
                    continue
                try:
                    data = sock.recv(65536)  # swallowed: nothing is ever answered
                except OSError:
                    data = b""
                if not data:
                    self._selector.unregister(sock)
                    sock.close()

    def __enter__(self) -> BlackHole:
        self._thread.start()
        return self

    def __exit__(self, *exc: tuple[type[BaseException] | None, BaseException | None,
                                   TracebackType | None]) -> None:
        self._stop.set()
        self._thread.join(5)
        for key in list(self._selector.get_map().values()):
            key.fileobj.close()  # type: ignore[union-attr]
        self._selector.close()
