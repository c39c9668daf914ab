"""A self-pipe that wakes a thread asleep in ``poll``/``select``: ``fd`` goes into the poll set, ``wake()``
makes it readable from any thread, ``drain()`` empties it once the sleeper is up, ``close()`` ends it. Used by
the threads that drive a transport's sockets (``progress``; erdma-quic's driver)."""

from __future__ import annotations

import os


class WakePipe:
    def __init__(self) -> None:
        self.fd, self._w = os.pipe()
        os.set_blocking(self.fd, False)
        os.set_blocking(self._w, False)

    def wake(self) -> None:
        try:
            os.write(self._w, b"x")
        except (BlockingIOError, OSError):  # full (a wake-up is pending anyway) or closed
            pass

    def drain(self) -> None:
        try:
            while os.read(self.fd, 4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def close(self) -> None:
        for fd in (self.fd, self._w):
            try:
                os.close(fd)
            except OSError:
                pass
