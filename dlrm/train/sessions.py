"""What a run records across its sessions (a session: one process's training of it, from its start or a
``--resume`` to its end): summary.json's ``sessions`` list and absolute paths, and the run's one HParams session in
TensorBoard, the latest session's.

summary.json is the last session's; a resumed session replaced it whole, and the earlier session's throughput,
device, wall time and settings were gone without a word. Its ``sessions`` keep each session's record
(`session_record`), carried over from the summary.json it replaces (`with_sessions`).
"""

from __future__ import annotations

import errno
import io
import os
import secrets
import struct
from pathlib import Path
from typing import Any, Optional

from loguru import logger

from dlrm.json_file import SUMMARY_LIMIT, read_json, read_regular_file

# summary.json's keys that name files or directories (``best`` holds one more: its ``checkpoint``)
PATH_KEYS = ("checkpoint", "run_dir", "best_checkpoint", "resumed_from")
# a session's own numbers and settings, as summary.json's top level holds the last session's
SESSION_KEYS = ("samples_per_sec", "data_wait_fraction", "warmup_s", "wall_s", "batch_size", "device", "device_name",
                "world_size", "versions")
HPARAMS_TAG_PREFIX = "_hparams_/"
"""The HParams plugin's summaries (experiment, session start and end): TensorBoard keeps the first it reads of a run."""
_REWRITE_TEMP = ".hparams-rewrite.{}.tmp"
"""An event file's rewrite in progress (`drop_earlier_hparams`): no "tfevents" in the name, so TensorBoard never loads
it (it loads every file whose name holds that), and a resume removes one a kill left (`dlrm.train.run_dir`)."""


def absolute(path: Any) -> Optional[str]:
    """`path` as an absolute path (symbolic links kept, as ``data.path`` is: a run's checkpoints/ may be a link to
    another disk), None as it is.

        >>> absolute("/runs/tb/r1/../r1/checkpoints/best.pt"), absolute(None)
        ('/runs/tb/r1/checkpoints/best.pt', None)
    """
    return None if path is None else os.path.abspath(os.fspath(path))


def absolute_paths(summary: dict[str, Any]) -> None:
    """Make `summary`'s paths (`PATH_KEYS`, ``best.checkpoint``) absolute, in place: recorded as the run saw them
    (relative to its working directory with a relative ``--tb-dir``, ``resumed_from`` as typed), a summary read from
    elsewhere (a sweep report, a notebook, ``--export`` of the finished run) named files that are not there."""
    for key in PATH_KEYS:
        if summary.get(key) is not None:
            summary[key] = absolute(summary[key])
    if isinstance(summary.get("best"), dict) and summary["best"].get("checkpoint") is not None:
        summary["best"] = {**summary["best"], "checkpoint": absolute(summary["best"]["checkpoint"])}


def session_hparams_of(summary: dict[str, Any]) -> Optional[dict[str, Any]]:
    """The HParams a session's summary stands for (`dlrm.train.reporting.session_hparams`), or None when its config
    does not read (an older version's)."""
    from dlrm.config import ConfigError, config_from_dict
    from dlrm.train.reporting import session_hparams

    try:
        resolved = summary.get("resolved") or {}
        sizes = (resolved.get("tables") or {}).get("multi_hot_sizes")
        # (as the session trained: "tf32" was fp32 on a CPU, "auto" kernels and compile resolved)
        return session_hparams(config_from_dict(summary["config"]), summary["batch_size"], sizes, resolved)
    except (KeyError, TypeError, ValueError, ConfigError):
        return None


def session_record(summary: dict[str, Any], previous_config: Optional[dict] = None) -> dict[str, Any]:
    """One session's entry in ``sessions``, from the summary it wrote: the steps it trained (``start_step`` to
    ``end_step``), where it resumed from, its throughput, wall time, device and library versions, its HParams, and the
    config keys it changed from `previous_config` (the resumed checkpoint's: ``{key: [old, new]}``; null for the
    first)."""
    from dlrm.train.resume_policy import config_changes, with_defaults

    record = {"start_step": summary.get("resumed_at_step") or 0, "end_step": summary.get("steps"), "recorded": True,
              "resumed_from": summary.get("resumed_from"), **{k: summary.get(k) for k in SESSION_KEYS},
              "hparams": session_hparams_of(summary), "config_changes": None}
    if isinstance(previous_config, dict) and isinstance(summary.get("config"), dict):
        changes = config_changes(with_defaults(previous_config), with_defaults(summary["config"]))
        record["config_changes"] = {k: [_json_value(old), _json_value(new)] for k, old, new in changes}
    return record


def _json_value(value: Any) -> Any:
    """A value `config_changes` names, as JSON holds it (its sentinel for a key one side lacks: null)."""
    return value if value is None or isinstance(value, (bool, int, float, str, list, dict)) else None


def _unrecorded(start: int, end: int) -> dict[str, Any]:
    """Steps trained by sessions that wrote no summary (stopped by a signal, killed; a branch's source run)."""
    return {"start_step": start, "end_step": end, "recorded": False}


def with_sessions(summary: dict[str, Any], path: Path, resumed_config: Optional[dict] = None) -> None:
    """Add ``sessions`` to `summary` (this session's, about to be written to `path`, summary.json), in place: the
    sessions of the summary.json there (the run's earlier ones), steps no summary recorded, then this one's.
    `resumed_config`: the config of the checkpoint this session resumed (the session that trained up to it), which
    its ``config_changes`` are from; without it, the summary.json's config."""
    earlier: list[dict[str, Any]] = []
    previous: Optional[dict] = None
    if Path(path).is_file():
        try:
            previous = read_json(path, SUMMARY_LIMIT)  # (a long run's: every logged loss)
            if not isinstance(previous, dict) or not isinstance(previous.get("steps"), int):
                raise ValueError(f"not a run's summary (a JSON {type(previous).__name__})")
        except (OSError, ValueError) as e:  # (UnicodeDecodeError and JSONDecodeError are ValueErrors)
            logger.warning(f"{path}: not readable ({e}); replaced by this session's, without the earlier sessions' "
                           "records it held")
            previous = None
    if previous is not None:
        listed = previous.get("sessions")
        earlier = [s for s in listed if isinstance(s, dict)] if isinstance(listed, list) else []
        if not earlier:  # written before summaries listed their sessions: its own top level is its last session's
            start = previous.get("resumed_at_step") or 0
            earlier = ([_unrecorded(0, start)] if start else []) + [session_record(previous)]
    start = summary.get("resumed_at_step") or 0
    reached = earlier[-1].get("end_step") if earlier else 0
    if isinstance(reached, int) and reached < start:
        earlier.append(_unrecorded(reached, start))
    # resumed from a checkpoint older than the run's last recorded step (the later ones removed): the earlier sessions'
    # steps past it were trained again by this one, and their ranges overlapped this one's as if both counted
    discarded = [s for s in earlier if isinstance(s.get("end_step"), int) and s["end_step"] > start]
    for s in discarded:  # an earlier mark that is no step (a hand-edited "x": a TypeError as the session ended) is none
        prior = s.get("discarded_after")
        s["discarded_after"] = min(start, prior) if type(prior) is int else start
    if discarded:
        logger.warning(f"{path}: this session resumed at step {start}, before the end of earlier sessions (step "
                       f"{max(s['end_step'] for s in discarded)}): their steps after {start} are recorded as discarded "
                       "(`discarded_after`), not as the run's")
    # from the checkpoint's config, not the summary.json's: after a session that wrote none (a signal stopped it,
    # having resumed with another learning rate), the change was said again as this session's, and one it made
    # itself was missed; and a resume from an older checkpoint of the run changes from that checkpoint's settings
    before = resumed_config if isinstance(resumed_config, dict) else (previous.get("config") if previous else None)
    summary["sessions"] = earlier + [session_record(summary, before)]


def drop_earlier_hparams(run_dir: Path, own: Optional[str]) -> Optional[dict[str, Any]]:
    """Remove the HParams summaries (`HPARAMS_TAG_PREFIX`) from `run_dir`'s event files other than `own` (this
    session's), each file rewritten whole and renamed over itself; returns the hparams the last of them held (None:
    there were none).

    TensorBoard keeps the first HParams session it reads of a run, the earliest event file's: a run resumed with other
    settings (a learning rate, a batch size, a swept key) showed its first session's values beside metrics of the
    session that ended it. Every other record of those files is kept byte for byte; a file that does not read to its
    end as records (damaged) is left alone, said."""
    from google.protobuf.message import DecodeError
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.plugins.hparams import plugin_data_pb2
    from tensorboard.summary.writer.record_writer import RecordWriter

    found = None
    for path in sorted(Path(run_dir).glob("events.out.tfevents.*")):
        if own is not None and os.path.abspath(path) == os.path.abspath(own):
            continue
        try:  # a handed-over run's FIFO of that name hung the session's end, a link to /dev/zero read without end; a
            if path.is_symlink():  # link no session writes: read through it, its target was copied here
                raise OSError(errno.EINVAL, "a symbolic link, which no session writes", str(path))
            data = read_regular_file(path)
        except OSError as e:
            logger.warning(f"{path}: not read ({e.strerror}); its HParams left as they are (TensorBoard may show an "
                           "earlier session's)")
            continue
        if HPARAMS_TAG_PREFIX.encode() not in data:
            continue
        records = _records(data)
        if records is None:
            logger.warning(f"{path}: does not read to its end as event records; its HParams left as they are "
                           "(TensorBoard may show an earlier session's)")
            continue
        out, held = io.BytesIO(), None
        try:
            for framed, body in records:
                if HPARAMS_TAG_PREFIX.encode() not in body:
                    out.write(framed)  # (as it was, CRCs and all)
                    continue
                event = Event.FromString(body)
                values = list(event.summary.value) if event.HasField("summary") else []
                ours = [v for v in values if v.tag.startswith(HPARAMS_TAG_PREFIX)]
                for v in ours:
                    if v.tag == HPARAMS_TAG_PREFIX + "session_start_info":
                        info = plugin_data_pb2.HParamsPluginData.FromString(v.metadata.plugin_data.content)
                        held = {k: _hparam_value(x) for k, x in info.session_start_info.hparams.items()}
                if not ours:
                    out.write(framed)
                elif len(ours) < len(values):
                    del event.summary.value[:]
                    event.summary.value.extend(v for v in values if not v.tag.startswith(HPARAMS_TAG_PREFIX))
                    RecordWriter(out).write(event.SerializeToString())
        except DecodeError:  # a damaged record (its CRC is not checked): the file left as TensorBoard reads it
            logger.warning(f"{path}: holds a damaged event record; its HParams left as they are (TensorBoard may "
                           "show an earlier session's)")
            continue
        _replace(path, out.getvalue())
        found = held if held is not None else found
    return found


def _records(data: bytes) -> Optional[list[tuple[bytes, bytes]]]:
    """(framed record, its body) of each TFRecord in `data` (length, its CRC, body, body CRC), or None when `data`
    is not records to its end (a length past the end, a damaged length)."""
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c

    records, pos = [], 0
    while pos < len(data):
        header = data[pos:pos + 12]
        if len(header) < 12 or struct.unpack("<I", header[8:])[0] != masked_crc32c(header[:8]):
            return None
        end = pos + 12 + struct.unpack("<Q", header[:8])[0] + 4
        if end > len(data):
            return None
        records.append((data[pos:end], data[pos + 12:end - 4]))
        pos = end
    return records


def _hparam_value(value) -> Any:
    kind = value.WhichOneof("kind")
    return getattr(value, kind) if kind else None


def _replace(path: Path, data: bytes) -> None:
    """`path` rewritten to hold `data`: a temporary file (fsync, `path`'s mode), renamed over it."""
    tmp = path.with_name(_REWRITE_TEMP.format(secrets.token_hex(4)))
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, path.stat().st_mode & 0o7777)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
