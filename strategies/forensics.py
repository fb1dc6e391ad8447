"""Hang forensics: where every rank is, kept in the process group's store for the others to read.

The hot loop only sets a few Python attributes (the phase, the batch index, two counters). A
daemon thread publishes them to the store about once a second, so knowing where a rank is costs
no collective and no network round trip per step. When a collective fails or times out, the rank
that saw it reads every rank's record and names the rank that fell behind and where it was,
instead of a bare watchdog timeout.

The same store carries failures: a rank that raises records its traceback and sets an abort
flag. The thread of every other rank sees the flag within a second and ends its process, so no
rank waits for a collective that will never complete (NCCL does not notice a dead peer), and the
launcher reports the first failure, the cause, rather than the others' broken connections.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from typing import Any

class Whereabouts:
    """Where this rank is, published to ``store`` by a background thread.

    Args:
        store: a store client of the process group (its own connection: the thread uses it).
        rank: this process's global rank; ``world_size``: the number of ranks.
        module: the user's module, read by the thread for the epoch and step (never per step).
        interval: seconds between publications.
    """

    def __init__(self, store: Any, rank: int, world_size: int, module: Any = None, interval: float = 1.0) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size
        self.module = module
        self.interval = interval
        self.phase = "setup"
        self.waiting = False
        self.batch_idx = -1
        self.batches = 0  # training_step calls so far
        self.collectives = 0  # collectives completed through the strategy
        self.phase_started = time.monotonic()
        self.failed = False  # this rank recorded a failure: its own thread must not end it early
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._parent = os.getppid()

    # --- the hot loop: plain attribute writes ----------------------------------------------
    def enter(self, phase: str, waiting: bool = False) -> None:
        """Note the phase this rank enters; ``waiting`` when it is a collective (it waits for peers)."""
        self.phase = phase
        self.waiting = waiting
        self.phase_started = time.monotonic()

    def start_batch(self, batch_idx: int) -> None:
        self.batch_idx = batch_idx
        self.batches += 1
        self.phase = "training_step"
        self.waiting = False
        self.phase_started = time.monotonic()

    # --- the thread --------------------------------------------------------------------------
    def start(self, watch_parent: bool = False) -> None:
        """Publish now, then about once a second until :meth:`stop`."""
        self.publish()
        self._watch_parent = watch_parent
        self._thread = threading.Thread(target=self._run, name=f"cadence-whereabouts-{self.rank}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def _run(self) -> None:
        errors = 0
        while not self._stop.wait(self.interval):
            if self._watch_parent and os.getppid() != self._parent:
                os._exit(1)  # the launching process died: nobody will collect this rank's result
            try:
                self.publish()
                if not self.failed and self.store.check(["abort"]):
                    self._stop_for_failure()
                errors = 0
            except Exception:  # the store's host went away; the group cannot work either
                errors += 1
                if errors >= 3:
                    return

    def _stop_for_failure(self) -> None:
        failed_rank = self.store.get("abort").decode()
        if self._stop.is_set() or self.failed:
            return
        print(
            f"[cadence] rank {self.rank}: stopping because rank {failed_rank} failed (its error is "
            "reported by the launcher).", file=sys.stderr, flush=True,
        )
        os._exit(1)

    def record(self) -> dict[str, Any]:
        module = self.module
        trainer = getattr(module, "trainer", None) if module is not None else None
        return {
            "rank": self.rank, "host": socket.gethostname(), "pid": os.getpid(), "phase": self.phase,
            "waiting": self.waiting,
            "batch_idx": self.batch_idx, "batches": self.batches, "collectives": self.collectives,
            "in_phase_s": round(time.monotonic() - self.phase_started, 1),
            "epoch": getattr(trainer, "current_epoch", None), "global_step": getattr(trainer, "global_step", None),
            "published": time.time(),
        }

    def publish(self) -> None:
        self.store.set(f"where/{self.rank}", json.dumps(self.record()))


def session_prefix(session: int) -> str:
    """The store prefix of one stage in one process (``session``: how many stages it set up before).
    A torchrun restart reuses the agent's store, so each attempt's keys (failures!) live apart."""
    return f"cadence/restart{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/session{session}/"


# --- reading the records --------------------------------------------------------------------------
def read_records(store: Any, world_size: int) -> dict[int, dict[str, Any]]:
    """Every rank's last published record that the store holds, by rank."""
    records = {}
    for rank in range(world_size):
        try:
            if store.check([f"where/{rank}"]):
                records[rank] = json.loads(store.get(f"where/{rank}"))
        except Exception:  # a best-effort report must not hide the error it explains
            continue
    return records


def describe_record(record: dict[str, Any]) -> str:
    where = f"in {record['phase']}"
    if is_dead(record):
        where = f"DIED (its process is gone); last seen {where}"
    if record["batches"]:
        epoch = f" of epoch {record['epoch']}" if record.get("epoch") is not None else ""
        where += f" at training batch {record['batch_idx']}{epoch} (global step {record.get('global_step')})"
    where += f", {record['collectives']} collectives done, for {record['in_phase_s']} s"
    age = time.time() - record["published"]
    if age > 5 and not is_dead(record):
        where += f"; no news for {age:.0f} s (dead, or stuck in C code holding the GIL?)"
    return f"rank {record['rank']} ({record['host']}, pid {record['pid']}): {where}"


def where_ranks_were(store: Any, world_size: int, me: dict[str, Any] | None = None) -> str:
    """Lines naming where each rank was; with ``me`` (the record of a rank whose collective
    failed), also which ranks had not reached that collective, or went elsewhere."""
    records = read_records(store, world_size)
    if me is not None:
        records[me["rank"]] = me
    if not records:
        return ""
    lines = ["Where each rank was (its last report):"]
    lines += [f"  {describe_record(records[rank])}" for rank in sorted(records)]
    missing = [rank for rank in range(world_size) if rank not in records]
    if missing:
        lines.append(f"  ranks {missing} never reported (they did not reach the process group).")
    if me is not None:
        lines += [_compare(record, me) for rank, record in sorted(records.items()) if rank != me["rank"]]
    return "\n".join(line for line in lines if line)


def collective_error(name: str, error: Exception, store: Any, world_size: int, me: dict[str, Any],
                     timeout_s: float) -> RuntimeError:
    """What a rank raises when its collective ``name`` failed with ``error``: torch's first line,
    where every rank was (``me``: this rank's record, taken when it failed), and what to do about it."""
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    report = where_ranks_were(store, world_size, me)
    if any(is_dead(record) for record in read_records(store, world_size).values()):
        hint = "The rank that died is the cause; the others stopped because it was gone."
    elif "timed out" in str(error).lower():
        hint = (f"If that work is legitimately slow, raise DDP(timeout=...) (now {timeout_s:g} s); "
                "otherwise look for code that only some ranks run.")
    else:
        hint = "Another rank probably failed or exited first; its error is the cause."
    return RuntimeError(f"{name} failed on rank {me['rank']} after {me['in_phase_s']} s: {first_line}\n{report}\n{hint}")


def fell_behind(other: dict[str, Any], me: dict[str, Any]) -> bool:
    """True when the rank of record ``other`` had not reached the collective ``me`` waited in."""
    counters = (other["batches"], other["collectives"])
    mine = (me["batches"], me["collectives"])
    if counters == mine and other["phase"] == me["phase"]:
        return False  # waiting at the same collective
    return counters < mine or (counters == mine and not other["waiting"])


def is_dead(record: dict[str, Any]) -> bool:
    """True when the rank of ``record`` ran on this machine and its process is gone (or a zombie,
    not yet reaped by its launcher). A rank on another machine is never known dead here: its
    record then says how long ago it last reported."""
    if record.get("host") != socket.gethostname():
        return False
    try:
        os.kill(record["pid"], 0)
    except ProcessLookupError:
        return True
    except OSError:  # it exists, owned by someone else: not ours to judge
        return False
    try:
        with open(f"/proc/{record['pid']}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return False


def _place(record: dict[str, Any]) -> str:
    if record["batches"] == 0:
        return f"{record['phase']} before its first training batch"
    return f"{record['phase']} at training batch {record['batch_idx']}"


def _compare(other: dict[str, Any], me: dict[str, Any]) -> str:
    """Whether ``other`` was waiting with ``me``, behind it, or somewhere else (or had died)."""
    if is_dead(other):
        epoch = f" of epoch {other['epoch']}" if other.get("epoch") is not None else ""
        return (f"Rank {other['rank']} died: its process (pid {other['pid']}) is gone, without a Python error (killed: "
                f"SIGKILL, the out-of-memory killer). It was last seen in {_place(other)}{epoch} (global step "
                f"{other.get('global_step')}), while rank {me['rank']} waited in {me['phase']}.")
    if other["phase"] == me["phase"] and (other["batches"], other["collectives"]) == (me["batches"], me["collectives"]):
        return ""  # waiting at the same collective
    place = _place(other)
    if fell_behind(other, me):
        return (f"Rank {other['rank']} fell behind: it was in {place} and had not reached "
                f"{me['phase']}, where rank {me['rank']} waited.")
    return (f"Rank {other['rank']} was in {place} instead of {me['phase']}: the ranks took different "
            "code paths (a collective, log or checkpoint that only some ranks run).")


# --- failures -------------------------------------------------------------------------------------
def record_failure(store: Any, rank: int, kind: str, text: str) -> None:
    """Note that ``rank`` failed (``kind`` is "error" for a cause, "collective" for a broken
    collective that follows another rank's failure) and raise the abort flag for the others."""
    try:
        order = store.add("failures", 1)
        store.set(f"failure/{rank}", json.dumps({"order": order, "kind": kind, "text": text}))
        store.set("abort", str(rank))
    except Exception:  # the store is gone; the launcher still has the worker's own traceback
        pass


def first_failure(store: Any, world_size: int, *, broken_collectives: bool = True) -> tuple[int, str] | None:
    """``(rank, text)`` of the failure that caused the others: the first rank that raised an
    error of its own, else (when ``broken_collectives``) the first broken collective."""
    failures = []
    for rank in range(world_size):
        try:
            if store.check([f"failure/{rank}"]):
                failure = json.loads(store.get(f"failure/{rank}"))
                failures.append((failure["kind"] != "error", failure["order"], rank, failure["text"]))
        except Exception:
            continue
    if not broken_collectives:
        failures = [failure for failure in failures if not failure[0]]
    if not failures:
        return None
    _, _, rank, text = min(failures)
    return rank, text
