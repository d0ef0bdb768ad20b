"""A loopback TCP proxy in front of the S3 server that breaks chosen connections: the network faults a client
must survive (connection reset, a response lost after the server acted, a response that never comes)."""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator

Mode = str  # "ok" | "reset" (RST at once) | "drop" (request reaches the server, its response is lost) | "stall"


def _rst(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()


class FlakyProxy:
    def __init__(self, upstream: tuple[str, int], plan: Callable[[int], Mode]) -> None:
        self.upstream, self.plan = upstream, plan
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.faults: list[tuple[int, Mode]] = []
        self._stop = threading.Event()
        self._n = 0

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def serve(self) -> None:
        self.listener.settimeout(0.2)
        while not self._stop.is_set():
            try:
                client, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            i, self._n = self._n, self._n + 1
            threading.Thread(target=self._handle, args=(client, i, self.plan(i)), daemon=True).start()

    def _handle(self, client: socket.socket, i: int, mode: Mode) -> None:
        if mode == "reset":
            self.faults.append((i, mode))
            _rst(client)
            return
        upstream = socket.create_connection(self.upstream)
        armed = [mode in ("drop", "stall")]

        def pump(src: socket.socket, dst: socket.socket, response: bool) -> None:
            try:
                while data := src.recv(65536):
                    if response and armed[0]:
                        armed[0] = False
                        self.faults.append((i, mode))
                        if mode == "stall":
                            time.sleep(5)  # past the client's read timeout
                        _rst(client)
                        _rst(upstream)
                        return
                    dst.sendall(data)
            except OSError:
                pass
            finally:
                for s in (src, dst):
                    with contextlib.suppress(OSError):
                        s.shutdown(socket.SHUT_RDWR)

        threading.Thread(target=pump, args=(client, upstream, False), daemon=True).start()
        pump(upstream, client, True)

    def close(self) -> None:
        self._stop.set()
        self.listener.close()


@contextlib.contextmanager
def flaky_proxy(endpoint: str, plan: Callable[[int], Mode]) -> Iterator[FlakyProxy]:
    host, port = endpoint.removeprefix("http://").split(":")
    proxy = FlakyProxy((host, int(port)), plan)
    t = threading.Thread(target=proxy.serve, daemon=True)
    t.start()
    try:
        yield proxy
    finally:
        proxy.close()
        t.join(5)
