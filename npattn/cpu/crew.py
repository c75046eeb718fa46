"""The crew: worker threads that stay awake for a moment after each call, so that calls in
quick succession hand their work items over without a system call.

:func:`npattn.cpu.threads.run_items` shares a call's items between the calling thread and
``threads - 1`` workers. Handing them to sleeping threads (a pool's futures) costs, on the
project's 2-core VMs, a wake-up per worker and a fight for the GIL at each end: at
(1, 8, 128 x 128, 64) a forward spent 25 us in the pool's submit, its worker started
20 us after the calling thread and the call returned 30 us after the worker's last item,
about 100 us of a 260 us call whose kernels took 160 us a thread.

A crew worker instead watches its slot (without the GIL, on ``pause``) for
``NPATTN_SPIN_US`` microseconds after each job (default :data:`DEFAULT_SPIN_US`) before it
sleeps on a condition:

- The calling thread posts a ticket (a plain store) and runs its own kernel. The worker
  takes the post (compare-and-swap of the ticket to its negative), waits until the calling
  thread has claimed an item (it is then in its kernel, without the GIL), and only then
  takes the GIL to call its kernel: neither thread waits on the other's GIL.
- When its items are done, the calling thread takes back the posts no worker took
  (compare-and-swap to 0: a sleeping worker's late wake-up then has nothing to run, like a
  pool future's cancel) and watches, without the GIL, each taken post's DONE slot, which
  the worker writes once it is back in its watch (so without the GIL too).
- A worker that finds nothing posted in its time sleeps; the calling thread rings for it.

Which thread runs an item still never changes the bits (the kernels claim items from the
call's counter). One call at a time has the crew; a call made while another holds it (calls
from several threads at once) uses the pool. ``NPATTN_SPIN_US=0`` turns the crew off.
The cost: a worker keeps its core busy for up to ``NPATTN_SPIN_US`` after a call (OpenMP's
threads, torch's among them, spin the same way, longer).
"""
from __future__ import annotations

import os
import threading
import time

import numpy as np
from numba import njit

from . import _cache  # noqa: F401  (before any @njit: stamps caches with the package hash)
from .counters import CLAIMED, COUNTER_SIZE, THREADS, compare_exchange, load_slot, pause, store_slot
from .environment import Setting

# How long a worker watches for the next call after a job, in microseconds, unless
# ``NPATTN_SPIN_US`` says otherwise: long enough for a loop's next call (a model's next
# layer, a decode step's next head group) after the Python between them.
DEFAULT_SPIN_US = 200

# The slots: one cache line of int64 per worker (row 1 on; no two workers' slots share a
# line), and row 0 for the crew: the polls a watch makes (NPATTN_SPIN_US in pauses).
_LINE = 8
WATCH_POLLS = 0
POSTED, DONE = 0, 1  # a worker's row: its post (0 none, t posted, -t taken), its last job done
# Polls a worker that took a post waits for the calling thread to claim an item (it is then
# in its kernel); past them it calls its kernel anyway (the calling thread may be compiling)
START_POLLS = 1024
# Polls the calling thread watches the taken posts' DONE slots before it naps between looks
# (a worker still in a long item)
DONE_POLLS = 4096
_NAP_S = 50e-6


def _nap() -> None:
    """The calling thread's sleep between looks at a worker still in a long item."""
    time.sleep(_NAP_S)


@njit(nogil=True, cache=True)
def _take_post(slots, base, counter, done):
    """(A worker, on its row at ``base``.) Mark job ``done`` done, then watch the row's post
    for ``slots[WATCH_POLLS]`` polls; take one (posted t becomes -t), wait up to
    START_POLLS for ``counter`` to show the poster's first claim, and return t. 0: none
    came (or the poster took it back first)."""
    store_slot(slots, base + DONE, done)
    polls = load_slot(slots, WATCH_POLLS)
    for _ in range(polls + 1):
        posted = load_slot(slots, base + POSTED)
        if posted > 0 and compare_exchange(slots, base + POSTED, posted, -posted):
            for _ in range(START_POLLS):
                if load_slot(counter, CLAIMED) >= 1:
                    break
                pause()
            return posted
        pause()
    return 0


@njit(nogil=True, cache=True)
def _take_back(slots, workers, ticket):
    """(The poster.) Take back ``ticket``'s posts that no worker took; return how many."""
    taken_back = 0
    for row in range(1, workers + 1):
        if compare_exchange(slots, row * _LINE + POSTED, ticket, 0):
            taken_back += 1
    return taken_back


@njit(nogil=True, cache=True)
def _jobs_done(slots, workers, ticket, polls):
    """(The poster.) Whether, within ``polls`` polls, every worker that took ``ticket`` is
    done with it and back in its watch."""
    for _ in range(polls + 1):
        done = True
        for row in range(1, workers + 1):
            base = row * _LINE
            if load_slot(slots, base + POSTED) == -ticket and load_slot(slots, base + DONE) != ticket:
                done = False
        if done:
            return True
        pause()
    return False


# The longest watch NPATTN_SPIN_US may ask for: 10 s
MAX_SPIN_US = 10_000_000


def _parsed_spin(configured: str) -> int:
    if not configured:
        return DEFAULT_SPIN_US
    if not configured.isdigit() or int(configured) > MAX_SPIN_US:
        raise ValueError(f"NPATTN_SPIN_US must be a whole number of microseconds from 0 to {MAX_SPIN_US} "
                         f"(or unset), got {configured!r}")
    return int(configured)


# ``spin_microseconds()``: NPATTN_SPIN_US as an int >= 0 (0: no crew), or DEFAULT_SPIN_US
# when unset; a ValueError naming the variable for any other value. Read at each call that
# shares its items.
spin_microseconds = Setting("NPATTN_SPIN_US", _parsed_spin)


class Crew:
    """``size`` worker threads with their slots. :meth:`run` runs a call's items on the
    calling thread and ``threads - 1`` of them; hold :attr:`lock` around it."""

    def __init__(self, size: int):
        self.size = size
        self.lock = threading.Lock()
        self.slots = np.zeros((size + 1) * _LINE, np.int64)
        self.counter = np.zeros(COUNTER_SIZE, np.int64)  # every run's, reset at its start
        self._jobs: list = [None] * size
        self._errors: list = [None] * size
        self._sleeping = [False] * size
        self._bell = threading.Condition()
        self._ticket = 0
        self._closed = False
        # a run left before its workers were done (an interrupt during its wait): a worker
        # may still use the counter, so the next call gets a new crew
        self.abandoned = False
        self._polls_per_us = _polls_per_microsecond()
        self.threads = [threading.Thread(target=self._work, args=(row,), name=f"npattn-crew-{row}", daemon=True)
                        for row in range(size)]
        for thread in self.threads:
            thread.start()

    def run(self, kernel, arguments, items: int, scratch, threads: int, spin_us: int) -> np.ndarray:
        """``kernel(*arguments, *scratch(), counter, items)`` on this thread and
        ``threads - 1`` workers (each with scratch of its own); returns a copy of the
        counter, once no worker has anything of this call left to do."""
        workers = threads - 1
        counter = self.counter
        counter[:] = 0
        counter[THREADS] = threads
        # every job made before the first post (a scratch allocation that fails posts none)
        jobs = [(kernel, (*arguments, *scratch(), counter, items)) for _ in range(threads)]
        self._ticket = ticket = self._ticket + 1
        self.slots[WATCH_POLLS] = max(1, int(spin_us * self._polls_per_us))
        self.abandoned = True  # (until every worker is done with this run)
        for row in range(workers):  # (the job before the post: the worker reads it after the post)
            self._jobs[row] = jobs[row + 1]
            self.slots[(row + 1) * _LINE + POSTED] = ticket
        if any(self._sleeping[:workers]):
            with self._bell:
                self._bell.notify_all()
        try:
            kernel(*jobs[0][1])
        finally:
            _take_back(self.slots, workers, ticket)
            while not _jobs_done(self.slots, workers, ticket, DONE_POLLS):
                _nap()  # (a worker still in a long item)
            self.abandoned = False
            self._jobs[:workers] = [None] * workers
            errors = [error for error in self._errors[:workers] if error is not None]
            self._errors[:workers] = [None] * workers
        if errors:
            raise errors[0]
        return counter.copy()

    def close(self) -> None:
        """Let the workers leave once they are out of their watch."""
        with self._bell:
            self._closed = True
            self._bell.notify_all()

    def _work(self, row: int) -> None:
        base, done = (row + 1) * _LINE, 0
        while not self._closed:
            ticket = _take_post(self.slots, base, self.counter, done)
            if ticket == 0:
                with self._bell:
                    self._sleeping[row] = True
                    while self.slots[base + POSTED] <= 0 and not self._closed:
                        self._bell.wait()
                    self._sleeping[row] = False
                continue
            kernel, arguments = self._jobs[row]
            try:
                kernel(*arguments)
            except BaseException as error:  # (raised from the call, on its own thread)
                self._errors[row] = error
            kernel = arguments = None  # (the call's arrays are not held past DONE)
            done = ticket


def _polls_per_microsecond() -> float:
    """Polls of a worker's watch per microsecond on this CPU (``pause`` takes about 10 ns
    on Zen cores, 40-60 on recent Intel ones): timed once."""
    slots, counter = np.zeros(2 * _LINE, np.int64), np.zeros(COUNTER_SIZE, np.int64)
    slots[WATCH_POLLS] = 8
    _take_post(slots, _LINE, counter, 0)  # (compiled or loaded first)
    slots[WATCH_POLLS] = polls = 4096
    start = time.perf_counter()
    _take_post(slots, _LINE, counter, 0)
    return polls / max((time.perf_counter() - start) * 1e6, 1e-3)


def prepare() -> None:
    """Compile (or load from Numba's cache) the crew's jitted functions now (npattn.warmup)."""
    slots, counter = np.zeros(2 * _LINE, np.int64), np.zeros(COUNTER_SIZE, np.int64)
    _take_post(slots, _LINE, counter, 0)
    _take_back(slots, 1, 1)
    _jobs_done(slots, 1, 1, 0)


_CREW: Crew | None = None
_CREW_LOCK = threading.Lock()


def crew_for(workers: int) -> Crew | None:
    """The process's crew, held (its :attr:`Crew.lock` acquired: release it after the run),
    with at least ``workers`` workers; None where another call holds it (the caller uses
    the pool). Made here, or made anew where it is too small or was abandoned."""
    global _CREW
    with _CREW_LOCK:
        crew = _CREW
        if crew is not None:
            if not crew.lock.acquire(blocking=False):
                return None
            if crew.size >= workers and not crew.abandoned:
                return crew
            crew.close()
            crew.lock.release()
        crew = _CREW = Crew(workers)
        crew.lock.acquire()
        return crew


def _forget_crew() -> None:
    """In a forked child: the parent's workers do not exist there."""
    global _CREW, _CREW_LOCK
    _CREW, _CREW_LOCK = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_crew)
