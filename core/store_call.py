"""A call to the rendezvous store that gives up (the roll call, the heartbeat watchdog): a frozen store host, or a cut
link to it, never answers, and TCPStore's check, get, multi_get and add then wait for ever (torch 2.13). A store
whose host died (StoreHostLine) is known without a call: a call to it prints torch's C++ warning, stack and all."""
from __future__ import annotations

import select
import socket
import threading
from typing import Optional

import torch.distributed as dist


class StoreCall(threading.Thread):
    """fn() in a daemon thread of its own, so that the caller can stop waiting for it (the thread stays behind,
    blocked, and ends with the process). `what`: the call; `address`: the store's; `host`: who hosts it."""

    def __init__(self, fn, what: str, address: str, host: str):
        super().__init__(name="store-call", daemon=True)
        self.fn, self.what, self.address, self.host = fn, what, address, host
        self.value, self.error = None, None
        self.start()

    def run(self) -> None:
        try:
            self.value = self.fn()
        except Exception as e:
            self.error = e

    def result(self, timeout_s: float):
        """fn's value, or its error; DistNetworkError if fn has not returned within timeout_s."""
        self.join(timeout_s)
        if self.is_alive():
            raise dist.DistNetworkError(f"the rendezvous store did not answer a call for {timeout_s:g} s: its host "
                                        f"({self.host}), or the network to it, is down ({self.what} at "
                                        f"{self.address}, from {socket.gethostname()})")
        if self.error is not None:
            raise self.error
        return self.value


class TimedStore:
    """A store whose every call gives up after `timeout_s` (StoreCall); once one did, the calls after it give up at
    once (a `finally` of the roll call would wait as long again)."""

    def __init__(self, store, timeout_s: float, address: str, host: str):
        self.store, self.timeout_s, self.address, self.host = store, timeout_s, address, host
        self.unanswered: Optional[Exception] = None

    def __getattr__(self, name: str):
        method = getattr(self.store, name)

        def timed(*args):
            if self.unanswered is not None:
                raise self.unanswered
            call = StoreCall(lambda: method(*args), name, self.address, self.host)
            try:
                return call.result(self.timeout_s)
            except dist.DistNetworkError as e:
                self.unanswered = e if call.is_alive() else None  # (else the store's own error: a broken pipe)
                raise
        return timed


class StoreHostLine:
    """A connection of our own to the store's port that never sends: its host closing it says the store is gone (the
    process died, kill -9 included) before a store call meets the closed connection, which torch 2.13 says on stderr
    with a C++ warning and its stack frames, for every call (TCPStore.cpp). `address`: (host, port)."""

    def __init__(self, address: tuple, timeout_s: float):
        self.address, self.timeout_s = address, timeout_s
        self.sock = socket.create_connection(address, timeout=timeout_s)
        self.gone = False
        self.lock = threading.Lock()  # (asked by the watchdog's thread and by the main thread's crash report)

    def host_gone(self, wait_s: float = 0.0) -> bool:
        """Whether the store's host closed our connection and nothing takes a new one (it is gone, not restarted),
        waiting up to wait_s for it to close."""
        with self.lock:
            return self._host_gone(wait_s)

    def _host_gone(self, wait_s: float) -> bool:
        if not self.gone and closed(self.sock, wait_s):
            self.sock.close()
            try:  # the store closed only ours, or its process restarted: watch a new connection
                self.sock = socket.create_connection(self.address, timeout=self.timeout_s)
                # a dying process closes its connections one by one, its listening socket maybe last: the connection
                # it took meanwhile is reset as it goes
                self.gone = closed(self.sock, wait_s=0.2)
            except OSError:  # refused: nothing listens there any more
                self.gone = True
        return self.gone


def closed(sock: socket.socket, wait_s: float) -> bool:
    """Whether the other end closed or reset `sock`, waiting wait_s for it (it never sends: the store speaks when
    asked)."""
    if not select.select([sock], [], [], wait_s)[0]:
        return False
    try:
        return sock.recv(1, socket.MSG_PEEK) == b""
    except OSError:  # reset
        return True
