"""A job as the state database holds it: the schema, a job's row, and the job read back from one.

Apart from ``store.py`` (the one thread, the files) because this is the format: the columns and what each
holds, in one place with the two mappings, so a column is added once. The request is stored as msgspec
JSON of ``JobRequest``: a field added to the request later is carried (and read back) without a line
here, and fields missing from old rows take their defaults. What a job's input images were (an edit, its
control and IP-Adapter images) is not stored: it lives in shared memory owned by the live job.
"""

from __future__ import annotations

import dataclasses
import json
import sqlite3
import time
from typing import Any

import msgspec

from diffusiond.daemon.core.jobs import Item, Job, JobRequest
from diffusiond.protocol import JobStatus, Stage

APPLICATION_ID = 0x64696664  # "difd": marks the file as ours (PRAGMA application_id)
SCHEMA_VERSION = 1
SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,  -- admission order: the queue's order after a restart
    id TEXT NOT NULL UNIQUE,
    created REAL NOT NULL,
    model TEXT NOT NULL,
    status TEXT NOT NULL,
    stage TEXT NOT NULL,
    sync INTEGER NOT NULL DEFAULT 0,
    attempts INTEGER NOT NULL DEFAULT 1,
    request TEXT NOT NULL,                   -- msgspec JSON of JobRequest
    seeds TEXT NOT NULL,                     -- JSON list, one per output
    error TEXT,                              -- JSON object, for jobs that did not succeed
    timings TEXT NOT NULL DEFAULT '{}',
    outputs TEXT NOT NULL DEFAULT '[]',      -- JSON list of {index, file, bytes, trajectory, lora_versions,
                                             --   weight_versions} (the last two absent from older records)
    bytes INTEGER NOT NULL DEFAULT 0,        -- the output files' total size (retention by size)
    edit INTEGER NOT NULL DEFAULT 0,         -- an edit: its input image is not kept, it cannot run again
    ended REAL
);
CREATE TABLE IF NOT EXISTS models (
    name TEXT PRIMARY KEY,
    capabilities TEXT NOT NULL               -- msgspec JSON of Capabilities, from the model's last READY
);
CREATE TABLE IF NOT EXISTS working (
    name TEXT PRIMARY KEY,                   -- the model's key, as in models
    peaks TEXT NOT NULL                      -- JSON of residency.working.Measurements.entry: peaks per shape
);
CREATE INDEX IF NOT EXISTS jobs_model ON jobs (model, seq);
CREATE INDEX IF NOT EXISTS jobs_status ON jobs (status, seq);
"""


def to_row(job: Job) -> dict[str, Any]:
    """What the database holds of a job (read on the loop, written in the store's thread)."""
    written = [i for i in job.items if i.file]
    return {
        "id": job.id,
        "created": job.created,
        "model": job.request.model,
        "status": job.status.value,
        "stage": job.stage.label,
        "sync": int(job.sync),
        "attempts": job.attempts,
        "request": msgspec.json.encode(_without_input(job.request)).decode(),
        "edit": int(_has_input(job.request)),  # control images are not kept either
        "seeds": json.dumps([i.seed for i in job.items]),
        "error": json.dumps(job.error) if job.error else None,
        "timings": json.dumps(job.timings_ms),
        "outputs": json.dumps([{"index": i.index, "file": i.file, "bytes": i.nbytes, "trajectory": i.trajectory_files,
                                "lora_versions": i.lora_versions, "weight_versions": i.weight_versions}
                               for i in written]),
        "bytes": sum(i.nbytes + sum(f["bytes"] for f in (i.trajectory_files or {}).values()) for i in written),
        "ended": time.time() if job.terminal else None,
    }


def _versions(value: Any) -> dict[str, int] | None:
    """An output's recorded versions, or None: a record written before they were kept has none, and one that
    does not read as names to integers is shown as unknown rather than failing the read of the whole job."""
    if not isinstance(value, dict) or not all(isinstance(k, str) and type(v) is int for k, v in value.items()):
        return None
    return value


def _has_input(request: JobRequest) -> bool:
    return any(getattr(request, k, None) is not None for k in ("edit", "control", "ip_adapter"))


def _without_input(request: JobRequest) -> JobRequest:
    """The request as stored: an edit's decoded input image (shared memory, owned by the live
    job) is not; the row says it was an edit (``Store.lost_inputs``)."""
    if not _has_input(request):
        return request
    # ``controls`` and ``ip_adapters`` still name the ControlNets and IP-Adapters (and digest the images)
    return dataclasses.replace(request, edit=None, control=None, ip_adapter=None)


class UnreadableRow(ValueError):
    """A row that does not decode as a job: a value damaged inside (which ``quick_check`` does not see), or a
    status or stage a newer diffusiond wrote. The store leaves it out rather than fail a start or a page."""


def from_row(row: sqlite3.Row) -> Job:
    """A job read back from its row: an unfinished one queued again, a finished one as it ended; raises
    ``UnreadableRow`` where it does not decode."""
    try:
        return _from_row(row)
    except (ValueError, KeyError, IndexError, TypeError, AttributeError, msgspec.MsgspecError) as exc:
        raise UnreadableRow(f"{type(exc).__name__}: {exc}") from exc


def _from_row(row: sqlite3.Row) -> Job:
    request = msgspec.json.decode(row["request"], type=JobRequest)
    status = JobStatus(row["status"])
    job = Job(request, id=row["id"], created=row["created"], status=status, sync=bool(row["sync"]),
              attempts=row["attempts"], error=json.loads(row["error"]) if row["error"] else None,
              timings_ms=json.loads(row["timings"]))
    stage = Stage[row["stage"].upper()] if status.terminal else Stage.QUEUED
    files = {o["index"]: o for o in json.loads(row["outputs"])}
    for k, seed in enumerate(json.loads(row["seeds"])):
        item = Item(job, k, seed=seed, stage=stage)
        # what its run was (an unfinished job runs again, with versions of its own; older records have none)
        if status.terminal and k in files:
            item.lora_versions = _versions(files[k].get("lora_versions"))
            item.weight_versions = _versions(files[k].get("weight_versions"))
        if status == JobStatus.SUCCEEDED and k in files:
            item.file, item.nbytes, item.stage = files[k]["file"], files[k]["bytes"], Stage.DONE
            item.trajectory_files = files[k].get("trajectory")
        job.items.append(item)
    if status.terminal:
        job.finished.set()
    return job


def row_id(row: sqlite3.Row) -> str:
    """A stored row's job id, where even that cannot be read."""
    try:
        return str(row["id"])
    except (IndexError, KeyError):
        return "(no id)"
