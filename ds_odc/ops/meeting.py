"""Where ranks meet: a barrier that times out and names the ranks that did not arrive, whatever carries the data.

ODC's ranks meet only at the optimizer step (and when a write outside the step must be published), so every meeting
must fail loudly instead of hanging. Waiting is gloo's ``monitored_barrier`` (it also notices a dead peer's closed
connection at once); *who* is missing comes from an arrival count each rank posts in a small key-value store hosted
by the group's first rank before it waits, so the error names ranks exactly rather than from gloo's message text.
A meeting that lasts a while reads those counts now and then as it waits: when the first rank, having found a rank
missing, raises and exits, the store goes with it, and the others must still name the rank that never came, not
the one that left last. Each rank also posts a pulse (a counter a background thread advances) so that, when a dead
peer's closed connection fails the barrier at once, a rank still on its way (pulse advancing) is told from one that
is gone or stopped (pulse still), without waiting out the timeout.

A meeting may carry a short *note* from every rank (what each believes the meeting is about, e.g. which minibatch
it is stepping): posted with the arrival count, in one request, and read back from the store once everyone has
arrived, in one more; the caller compares them. Notes live in two slots per rank that alternate from one meeting to
the next, so a fast rank's next note never overwrites one a slow rank has still to read. A rank that finishes (its
engine destroyed, or :func:`leave_meetings` at shutdown) says so in the store, and a meeting it misses says so too.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import weakref
from datetime import timedelta

import torch.distributed as dist

from ds_odc.ops.transport import FenceTimeout, OdcError

__all__: list[str] = []

_STORE_REPLY_S = 5.0  # how long the post-mortem may wait for the store when a meeting has already failed
_WATCH_AFTER_S = 1.0  # a meeting still waiting after this long starts reading who has arrived
_WATCH_EVERY_S = 0.5
_PULSE_EVERY_S = 0.5
_STILL_AFTER_S = 3.0  # a pulse that has not moved for this long: the rank is dead or stopped
_LIVE: weakref.WeakSet = weakref.WeakSet()  # this process's meetings (that have a store), for leave_meetings


def leave_meetings(why: str) -> None:
    """Tell the other ranks of every meeting of this process that this rank will not come again (``why``: what it
    did, e.g. "reached shutdown()"), so that a meeting they wait in names it as finished rather than as late."""
    for meeting in list(_LIVE):
        meeting.leave(why)


def control_group(process_group=None):
    """A gloo group over the same ranks as ``process_group``: meetings must time out and name ranks, whatever backend
    carries the training collectives."""
    if dist.get_backend(process_group) == "gloo":
        return process_group
    ranks = dist.get_process_group_ranks(process_group) if process_group is not None else None
    return dist.new_group(ranks=ranks, backend="gloo")


def reachable_address() -> str:
    """An address of this host that the job's other hosts can reach: ``MASTER_ADDR`` on the rank that hosts it, else
    this host's address on the route towards it."""
    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    if dist.get_rank() == 0:
        return master
    try:
        family, kind, _, _, where = socket.getaddrinfo(master, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, kind) as probe:
            probe.connect(where)  # a datagram socket sends nothing on connect: this only picks the interface
            return probe.getsockname()[0]
    except OSError:
        return socket.gethostname()


class Meeting:
    """Collective arrival of the ranks of ``process_group`` with a timeout (collective to construct).

    ``control``: a gloo group over the same ranks, when the caller has one (a group over part of the job must be
    created by every rank of the job at once, so it cannot be made here)."""

    def __init__(self, process_group=None, timeout_s: float = 300.0, control=None):
        self.group = control_group(process_group) if control is None else control
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        # errors name ranks as the job numbers them, whatever part of the job meets here
        self.job_ranks = (list(range(self.world_size)) if self.group is None else
                          [dist.get_global_rank(self.group, r) for r in range(self.world_size)])
        self.timeout_s = timeout_s
        self.arrivals = 0
        self.left: str | None = None  # what this rank said when it left (leave)
        self.store = self._open_store()
        if self.store is not None:
            threading.Thread(target=_advance_pulse, args=(self.store, self._pulse_key(self.rank)), name="ds_odc-pulse",
                             daemon=True).start()
            _LIVE.add(self)

    def _open_store(self):
        """A TCP store on the group's first rank, where each rank posts how many meetings it has reached. Optional: if
        it cannot be opened (no reachable address), meetings still time out, naming no ranks. The group's first rank
        need not be the job's (a shard group on another node), so it sends its own address with the port."""
        store, where = None, [None]
        if self.rank == 0:
            try:
                host = reachable_address()
                store = dist.TCPStore(host, 0, None, True, timedelta(seconds=self.timeout_s), wait_for_workers=False)
                where = [(host, store.port)]
            except Exception:  # noqa: BLE001 - the store only improves error messages
                store = None
        first = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        dist.broadcast_object_list(where, src=first, group=self.group)
        if where[0] is None:
            return None
        try:
            if store is None:
                host, port = where[0]
                store = dist.TCPStore(host, port, None, False, timedelta(seconds=self.timeout_s))
            store.multi_set([self._key(self.rank), self._pulse_key(self.rank), self._note_key(self.rank, 0),
                             self._note_key(self.rank, 1)], ["0", "0", "0|", "0|"])
        except Exception:  # noqa: BLE001
            store = None
        ok = [store is not None]
        everyone = [None] * self.world_size
        dist.all_gather_object(everyone, ok[0], group=self.group)
        return store if all(everyone) else None

    @staticmethod
    def _key(rank: int) -> str:
        return f"ds_odc/arrived/{rank}"

    @staticmethod
    def _pulse_key(rank: int) -> str:
        return f"ds_odc/pulse/{rank}"

    @staticmethod
    def _note_key(rank: int, arrival: int) -> str:
        return f"ds_odc/note/{rank}/{arrival % 2}"

    @staticmethod
    def _left_key(rank: int) -> str:
        return f"ds_odc/left/{rank}"

    def __call__(self, what: str, timeout_s: float | None = None,
                 note: str | None = None) -> dict[int, str | None] | None:
        """Wait until every rank has arrived at this meeting, or raise :class:`FenceTimeout` naming the others.

        With ``note`` (a short string; "" for none), return every rank's note by job rank (``None`` for a rank that
        posted none at this meeting); None when no note was given or this meeting has no store to carry notes."""
        self.arrivals += 1
        timeout = self.timeout_s if timeout_s is None else timeout_s
        if self.store is not None:
            if note is None:
                self.store.set(self._key(self.rank), str(self.arrivals))
            else:
                self.store.multi_set([self._key(self.rank), self._note_key(self.rank, self.arrivals)],
                                     [str(self.arrivals), f"{self.arrivals}|{note}"])
        watch = _Watch(self) if self.store is not None else None
        deadline = time.monotonic() + timeout
        try:
            dist.monitored_barrier(group=self.group, timeout=timedelta(seconds=timeout), wait_all_ranks=True)
        except RuntimeError as err:
            seen = watch.stop() if watch is not None else None
            missing = self.missing(seen, until=deadline)
            who = f"ranks {missing} did not arrive" if missing else "a peer did not arrive or died"
            left = self.departures(missing)
            if left:
                who += "; " + "; ".join(f"rank {r} will not come: it has finished ({why})" for r, why in left.items())
                advice = ("A rank that finishes while the others still meet took fewer optimizer steps than they did: "
                          "every rank must call engine.step() once per minibatch, also when it has no microbatch in "
                          "it (k == 0), and every rank must train the same number of minibatches.")
            else:
                advice = ("Look at the logs of those ranks; if their minibatch is legitimately longer, raise "
                          "zero_optimization.odc.timeout_s.")
            raise FenceTimeout(
                f"ds_odc: rank {self.job_ranks[self.rank]}: {what} did not complete within {timeout:g} s: {who}. "
                f"{advice} (backend said: {str(err).strip()[:300]})", missing) from err
        if watch is not None:
            watch.stop()
        if note is None or self.store is None:
            return None
        try:
            return self._notes()
        except OdcError:
            raise
        except Exception as err:  # noqa: BLE001 - a store that answered a moment ago: its host has died
            raise OdcError(f"ds_odc: rank {self.job_ranks[self.rank]}: after {what}, the ranks' notes could not be "
                           f"read from the meeting's store on rank {self.job_ranks[0]}: that rank has probably died; "
                           f"look at its log. ({err})") from err

    def _notes(self) -> dict[int, str | None]:
        """Every rank's note of this meeting (after everyone arrived). When they differ the callers will fail, and the
        store lives in the group's first rank: that rank keeps it up until every rank has read the notes."""
        posted = self.store.multi_get([self._note_key(r, self.arrivals) for r in range(self.world_size)])
        notes = {}
        for r, value in enumerate(posted):
            arrival, _, text = value.decode().partition("|")
            notes[self.job_ranks[r]] = text if int(arrival) == self.arrivals else None
        if len(set(notes.values())) > 1:
            read = f"ds_odc/notes_read/{self.arrivals}"
            count = self.store.add(read, 1)
            deadline = time.monotonic() + _STORE_REPLY_S
            while self.rank == 0 and count < self.world_size and time.monotonic() < deadline:
                time.sleep(0.05)
                count = self.store.add(read, 0)
        return notes

    def leave(self, why: str) -> None:
        """This rank will not come to this meeting again (``why``: what it did, the first one told); see
        :func:`leave_meetings`."""
        if self.store is not None and self.left is None:
            self.left = why
            try:
                self.store.set(self._left_key(self.rank), why)
            except Exception:  # noqa: BLE001 - the store only improves error messages
                pass

    def departures(self, ranks: list[int]) -> dict[int, str]:
        """Of ``ranks`` (job ranks), those that said they left, with what they did (empty when that cannot be told)."""
        if self.store is None or not ranks:
            return {}
        found = {}
        try:
            self.store.set_timeout(timedelta(seconds=_STORE_REPLY_S))
            for r in range(self.world_size):
                if self.job_ranks[r] in ranks and self.store.check([self._left_key(r)]):
                    found[self.job_ranks[r]] = self.store.get(self._left_key(r)).decode()
        except Exception:  # noqa: BLE001 - the store's host may be gone
            pass
        return found

    def counts(self, reply_s: float | None = None) -> dict[int, int]:
        """Every rank's posted arrival count, by rank in this group (raises if the store does not answer)."""
        if reply_s is not None:
            self.store.set_timeout(timedelta(seconds=reply_s))
        return {r: int(self.store.get(self._key(r))) for r in range(self.world_size)}

    def missing(self, seen: dict[int, int] | None = None, until: float | None = None) -> list[int]:
        """Ranks (of the job) whose posted arrival count is behind this rank's (empty when that cannot be told).
        When the store no longer answers, the counts ``seen`` while waiting tell; without them, the store's host is
        named. ``until`` (a ``time.monotonic()`` deadline): a barrier fails at once when a peer's connection closes,
        while a live rank may still be on its way; ranks behind are re-read until each has come or its pulse has
        stood still for a few seconds, or the meeting's timeout is over, so a rank that is merely late is not named."""
        if self.store is None:
            return []
        pulses: dict[int, tuple[str, float]] = {}  # rank -> (last pulse read, when it last moved)
        while True:
            try:
                counts = self.counts(reply_s=_STORE_REPLY_S)
            except Exception:  # noqa: BLE001 - the store's host may be the rank that died, or left after failing
                if seen is None:
                    return [self.job_ranks[0]] if self.rank != 0 else []
                counts, until = seen, None
            behind = [r for r in range(self.world_size) if r != self.rank and counts.get(r, 0) < self.arrivals]
            if not behind or until is None or time.monotonic() >= until or self._none_coming(behind, pulses):
                return [self.job_ranks[r] for r in behind]
            seen = counts
            time.sleep(_WATCH_EVERY_S)

    def _none_coming(self, ranks: list[int], pulses: dict[int, tuple[str, float]]) -> bool:
        """Whether each of ``ranks`` has left (:meth:`leave`) or not moved its pulse for ``_STILL_AFTER_S``
        (``pulses`` keeps what was read)."""
        now = time.monotonic()
        try:
            for r in ranks:
                if self.store.check([self._left_key(r)]):
                    pulses[r] = ("left", float("-inf"))
                    continue
                beat = self.store.get(self._pulse_key(r)).decode()
                if r not in pulses or pulses[r][0] != beat:
                    pulses[r] = (beat, now)
        except Exception:  # noqa: BLE001 - the store stopped answering: the next count read says so
            return False
        return all(now - pulses[r][1] >= _STILL_AFTER_S for r in ranks)


def _advance_pulse(store, key: str) -> None:
    """Advance this rank's pulse in a meeting's store, in a daemon thread: it stops with the process, or when the
    store stops answering (its host has gone, and nobody is left to read the pulse)."""
    beat = 0
    while True:
        time.sleep(_PULSE_EVERY_S)
        beat += 1
        try:
            store.set(key, str(beat))
        except Exception:  # noqa: BLE001
            return


class _Watch:
    """Reads the arrival counts in the background while a meeting waits (after a short grace period), so that its
    post-mortem survives the store's host leaving."""

    def __init__(self, meeting: Meeting):
        self.meeting = meeting
        self.seen: dict[int, int] | None = None
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, name="ds_odc-meeting-watch", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        if self.done.wait(_WATCH_AFTER_S):
            return
        while not self.done.is_set():
            try:
                self.seen = self.meeting.counts()
            except Exception:  # noqa: BLE001 - the host is gone: keep the last counts read
                return
            self.done.wait(_WATCH_EVERY_S)

    def stop(self) -> dict[int, int] | None:
        self.done.set()
        self.thread.join(timeout=_STORE_REPLY_S)
        return self.seen
