"""The file-system calls of a tier that may hang, each waited for at most a deadline.

A local file system answers a create, a rename or an fsync, or fails it. A network or FUSE one may
hold the call for as long as its server is away: a GlusterFS client gives up after its ping-timeout
(42 s by default), an NFS hard mount never. The writer thread makes such calls for every tier in
turn, so a tier that hung in one held the writes of all, and every put waited for it. On a tier that
may hang, the writer's calls (a temporary file's create, the commit's fdatasync, close and rename, an
eviction's unlink, fsync=full's directory sync), clear()'s listings, check()'s first look, the catch-up
thread's look and source read, a failed tier's recovery probe, and its start-up (its real path, which says
whether it is local, its probe and set-up: probe.py, tiers.py; one that does not answer starts failed) run
on the tier's own thread, and the
caller waits at most ``timeout`` s (write_timeout): then ETIMEDOUT, which fails the tier (tiers.py),
and the caller goes on with the other tiers. A get's open of a page file, discovery's look at one (a
put's, get's or lookup's own thread: SGLang's batch_exists) and usage()'s statvfs run on a second
thread of the tier (reads never queue behind the writer's calls: read priority, priority.py), waited
for at most what is left of the caller's read_timeout as well: where that ends
first, ETIME, and the tier is not failed for it (a get short of time proves no hang; a call out past
write_timeout does, and fails the next one at once).

A call cannot be taken back. When one given up on returns, ``late(result)`` undoes what it made (a
temporary file closed and removed, a buffer handed back). While a call has been out longer than the
deadline, each new one fails at once: the tier is hung, and waiting behind it would hold the caller
again. A clean-up (``post``: a temporary file to remove) is waited for at most the deadline, and not
at all on a hung tier: it runs when the thread gets to it.

:func:`shielded` is the other kind of call on a thread of its own: one waited for whole, which no
Ctrl-C cuts half-way (a put's withdrawal, clear()'s cancelling of the writes).
"""
from __future__ import annotations

import errno
import logging
import queue
import threading
import time
from collections.abc import Callable

log = logging.getLogger("kvstream")


class GivenUp(OSError):
    """ETIMEDOUT for a call given up on while it runs (or waits to): what it uses (a buffer it reads
    into) is still its own until it ends, then ``late``'s; ETIME where the caller's own time (``within``)
    ran out before the deadline: the tier is not known to hang. A call refused at once because another
    is hung (ETIMEDOUT), or because the caller has no time left (ETIME), raises a plain OSError: it never
    ran."""


class _Call:
    __slots__ = ("fn", "args", "late", "done", "value", "error", "claim")

    def __init__(self, fn: Callable, args: tuple, late: Callable | None):
        self.fn, self.args, self.late = fn, args, late
        self.done = threading.Event()
        self.value = self.error = None
        self.claim = [None]  # popped once (atomic): by the caller who gives up, or by the thread that ends it
        # first; whoever pops owns the result (the caller returns it, the thread hands it to ``late``)


class BoundedCalls:
    """Calls on one tier's file system, waited for at most ``timeout`` s (0: no limit, called in place;
    inf: no limit of its own, only a caller's ``within``).

    :param name: the tier, for messages and the thread's name.
    """

    def __init__(self, name: str, timeout: float):
        self.name, self.timeout = name, timeout
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._since: float | None = None  # when the call the thread is on began (None: idle)
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name=f"kvstream-calls-{name}", daemon=True)
        self._unstarted = [None]  # popped once (atomic) by the first call: the thread starts then, so an
        # engine whose start fails after its tiers were made leaves no thread behind

    def close(self) -> None:
        """The thread ends once it has run what was posted before (at once where no call hangs); a call
        made later (a hung write's clean-up, in a thread of its own) runs in place."""
        self._closed = True
        if not self._unstarted:  # (started: it ends after what was posted)
            self._calls.put(None)

    def hung(self) -> bool:
        """A call has been out longer than the deadline."""
        since = self._since
        return since is not None and time.monotonic() - since > self.timeout

    def run(self, fn: Callable, *args, late: Callable | None = None, within: float | None = None):
        """``fn(*args)``'s result (or its exception), waited for at most the deadline, or ``within`` s
        where that is less (what is left of a get's read_timeout).
        :raises GivenUp: ETIMEDOUT, the call given up on (``late`` gets its result when it ends).
        :raises OSError: ETIMEDOUT, a call out longer than the deadline is still out (``fn`` never runs)."""
        if self._direct():
            return fn(*args)
        if self.hung():
            raise OSError(errno.ETIMEDOUT, f"an earlier call on {self.name} has not returned for "
                                           f"{self.timeout:g} s (write_timeout)")
        wait = self.timeout if within is None else min(within, self.timeout)
        if wait <= 0:
            raise OSError(errno.ETIME, f"no time left for a call on {self.name} (read_timeout)")
        since = self._since
        if within is not None and since is not None and time.monotonic() - since > wait:
            # (behind a call out longer than this caller's whole time, it could not start in time: with
            # write_timeout=0 a hung tier is never judged hung, and each lookup waited all its read_timeout)
            raise OSError(errno.ETIME, f"a call on {self.name} has been out longer than the caller's {wait:g} s "
                                       "(read_timeout)")
        call = _Call(fn, args, late)
        self._put(call)
        if not call.done.wait(None if wait == float("inf") else wait):  # (inf: no deadline but the caller's)
            try:
                call.claim.pop()  # given up on: the thread hands the result to ``late``
                if wait < self.timeout:  # (the caller's time, not the tier's: hung() judges the tier later)
                    raise GivenUp(errno.ETIME, f"a call on {self.name} outlasted the caller's {wait:g} s "
                                               "(read_timeout)")
                raise GivenUp(errno.ETIMEDOUT, f"a call on {self.name} did not return in {wait:g} s "
                                               "(write_timeout)")
            except IndexError:
                call.done.wait()  # (it ended as the wait did: the result is the caller's after all)
        if call.error is not None:
            raise call.error
        return call.value

    def post(self, fn: Callable, *args) -> None:
        """Run ``fn(*args)`` (a clean-up that must not raise), waited for at most the deadline, and not
        at all while a call is out longer than it: then it runs when the tier answers."""
        if self._direct():
            fn(*args)
            return
        call = _Call(fn, args, None)
        call.claim.pop()  # (nobody takes its result)
        hung = self.hung()
        self._put(call)
        if not hung:
            call.done.wait(self.timeout)

    def _put(self, call: _Call) -> None:
        try:
            self._unstarted.pop()
            self._thread.start()
        except IndexError:  # (started already)
            pass
        self._calls.put(call)

    def _direct(self) -> bool:
        """Called in place: no deadline, or a call made by a call (it runs on the thread already)."""
        return self.timeout <= 0 or self._closed or threading.current_thread() is self._thread

    def _serve(self) -> None:
        while True:
            call = self._calls.get()
            if call is None:
                return
            self._since = time.monotonic()
            try:
                call.value = call.fn(*call.args)
            except BaseException as exc:  # (handed to the caller, who raises it)
                call.error = exc
            self._since = None
            try:
                call.claim.pop()  # the caller still waits: the result is its
                call.done.set()
            except IndexError:  # given up on (or posted): undo what it made
                call.done.set()
                if call.late is not None and call.error is None:
                    try:
                        call.late(call.value)
                    except Exception:  # (a clean-up that failed: start-up removes what is left)
                        log.debug("kvstream: %s: undoing a late call failed", self.name, exc_info=True)


def shielded(work: Callable[[], None]) -> BaseException | None:
    """Run ``work`` on a thread of its own, which no signal reaches (Python delivers them to the main
    thread), and wait for it whole: an interrupt (Ctrl-C) that comes meanwhile cannot cut it half-way
    (state it changes in steps left between two of them: pages counted for ever, puts never answered).
    Raises ``work``'s own error once it is over; else returns the first interrupt that came meanwhile
    (None: none), for the caller to raise or let go on. (One that lands in the instant between the
    thread's start and the wait goes on at once: the work still runs whole, on its thread.)"""
    failed: list[BaseException] = []
    over = threading.Event()

    def run() -> None:
        try:
            work()
        except BaseException as exc:  # noqa: BLE001 (handed to the caller)
            failed.append(exc)
        finally:
            over.set()

    threading.Thread(target=run, name="kvstream-shielded", daemon=True).start()
    interrupt: BaseException | None = None
    while True:
        try:  # (an Event, not Thread.join: a join that an interrupt cuts (CPython 3.11) marks the thread
            over.wait()  # stopped though it runs, and the next join returns at once: the put whose
            break  # withdrawal this waits for raised with its write still reading the caller's memory)
        except BaseException as exc:  # noqa: BLE001 (a Ctrl-C: after the work)
            interrupt = interrupt or exc
    if failed:
        raise failed[0]
    return interrupt
