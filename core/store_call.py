"""A call to the rendezvous store that gives up (the roll call, the heartbeat watchdog): a frozen store host, or a cut
link to it, never answers, and TCPStore's check, get, multi_get and add then wait for ever (torch 2.13)."""
from __future__ import annotations

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
