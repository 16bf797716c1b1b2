"""Read what the bridges wrote, with each backend's own reader (no mocks of the backends).

* TensorBoard: `plugin_event_accumulator.EventAccumulator` with size_guidance 0 (keep everything); it
  normalises every writer's scalars, text and histograms to tensors with plugin metadata.
* W&B offline: the `.wandb` transaction log (LevelDB-log framing, `wandb_internal_pb2.Record` payloads),
  since `wandb sync --view` and `wandb.sdk.internal.datastore` no longer exist in 0.31.
* MLflow: `MlflowClient` (metric history with steps, params, artifacts).
"""

from __future__ import annotations

import glob
import json
import os
import struct
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# -- TensorBoard -------------------------------------------------------------------------------------


@dataclass
class TBRun:
    scalars: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    text: dict[str, list[tuple[int, str]]] = field(default_factory=dict)
    # (step, [(left, right, count), ...]) per histogram tag
    histograms: dict[str, list[tuple[int, list[tuple[float, float, float]]]]] = field(default_factory=dict)
    hparams: dict[str, Any] = field(default_factory=dict)
    session_end_status: int | None = None
    has_experiment_tag: bool = False


def read_tensorboard(log_dir: str | os.PathLike[str]) -> TBRun:
    """Everything in one run directory (event files directly in `log_dir`, not sub-runs)."""
    from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import metadata as hp_metadata
    from tensorboard.plugins.hparams import plugin_data_pb2
    from tensorboard.util import tensor_util

    ea = EventAccumulator(str(log_dir), size_guidance={"tensors": 0})
    ea.Reload()
    out = TBRun()
    for tag in ea.PluginTagToContent("scalars") if "scalars" in ea.ActivePlugins() else {}:
        out.scalars[tag] = [
            (e.step, float(tensor_util.make_ndarray(e.tensor_proto))) for e in ea.Tensors(tag)
        ]
    for tag in ea.PluginTagToContent("text") if "text" in ea.ActivePlugins() else {}:
        key = tag.removesuffix("/text_summary")
        out.text[key] = [
            (e.step, b"".join(tensor_util.make_ndarray(e.tensor_proto).ravel().tolist()).decode())
            for e in ea.Tensors(tag)
        ]
    for tag in ea.PluginTagToContent("histograms") if "histograms" in ea.ActivePlugins() else {}:
        out.histograms[tag] = [
            (e.step, [tuple(map(float, row)) for row in tensor_util.make_ndarray(e.tensor_proto)])  # type: ignore[misc]
            for e in ea.Tensors(tag)
        ]
    if "hparams" in ea.ActivePlugins():
        content = ea.PluginTagToContent("hparams")
        out.has_experiment_tag = hp_metadata.EXPERIMENT_TAG in content
        if hp_metadata.SESSION_START_INFO_TAG in content:
            data = plugin_data_pb2.HParamsPluginData.FromString(content[hp_metadata.SESSION_START_INFO_TAG])
            for name, value in data.session_start_info.hparams.items():
                kind = value.WhichOneof("kind")
                out.hparams[name] = getattr(value, kind) if kind else None
        if hp_metadata.SESSION_END_INFO_TAG in content:
            data = plugin_data_pb2.HParamsPluginData.FromString(content[hp_metadata.SESSION_END_INFO_TAG])
            out.session_end_status = int(data.session_end_info.status)
    return out


# -- W&B offline -------------------------------------------------------------------------------------

_BLOCK = 32768
_HEADER = 7


def iter_wandb_records(path: str | os.PathLike[str]) -> Iterator[Any]:
    """Records of a `.wandb` file: 7-byte file header, 32 KiB blocks of CRC-checked chunks."""
    from wandb.proto import wandb_internal_pb2 as pb

    buf = Path(path).read_bytes()
    magic, version, _ = struct.unpack("<4sHB", buf[:7])
    assert (magic, version) == (b":W&B", 0xBEE1), f"{path} is not a W&B transaction log"
    i, pending = 7, b""
    while i + _HEADER <= len(buf):
        left = _BLOCK - (i % _BLOCK)
        if left < _HEADER:  # zero padding at the tail of a block
            i += left
            continue
        crc, n, typ = struct.unpack("<IHB", buf[i : i + _HEADER])
        i += _HEADER
        if i + n > len(buf):  # a chunk still being written
            break
        data = buf[i : i + n]
        i += n
        if typ == 0 and n == 0:  # zero padding / preallocated tail
            continue
        assert zlib.crc32(data, zlib.crc32(bytes([typ]))) & 0xFFFFFFFF == crc, f"bad CRC in {path}"
        if typ in (2, 3):  # FIRST, MIDDLE
            pending = (pending if typ == 3 else b"") + data
            continue
        if typ == 4:  # LAST
            data, pending = pending + data, b""
        elif typ != 1:  # not FULL
            break
        record = pb.Record()  # type: ignore[attr-defined]
        record.ParseFromString(data)
        yield record


def _set_path(target: dict[str, Any], path: list[str], value: Any) -> None:
    for part in path[:-1]:
        target = target.setdefault(part, {})
    target[path[-1]] = value


def _flatten_row(nested: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Undo nesting: media objects (dicts with `_type`) stay whole; other dicts join keys with '/'."""
    out: dict[str, Any] = {}
    for key, value in nested.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and "_type" not in value and value:
            out.update(_flatten_row(value, f"{name}/"))
        else:
            out[name] = value
    return out


def _items_to_dict(items: Any) -> dict[str, Any]:
    nested: dict[str, Any] = {}
    for item in items:
        path = [item.key] if item.key else list(item.nested_key)
        _set_path(nested, path, json.loads(item.value_json))
    return _flatten_row(nested)


@dataclass
class WandbOfflineRun:
    run_dir: Path  # .../wandb/offline-run-<ts>-<id>
    run_id: str = ""
    name: str = ""
    project: str = ""
    group: str = ""
    tags: list[str] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    metric_defs: list[dict[str, str]] = field(default_factory=list)
    record_kinds: list[str] = field(default_factory=list)
    exited: bool = False
    exit_code: int | None = None  # the exit record's: 0 finished, else failed

    def series(self, key: str, step_key: str = "train/step") -> list[tuple[int, Any]]:
        """(training step, value) for every history row that has `key`."""
        return [(int(row[step_key]), row[key]) for row in self.history if key in row and step_key in row]

    def table(self, value: dict[str, Any]) -> dict[str, Any]:
        """Contents of a logged `wandb.Table` (history value of `_type` table-file)."""
        data: dict[str, Any] = json.loads((self.run_dir / "files" / value["path"]).read_text())
        return data


def find_wandb_offline_runs(root: str | os.PathLike[str]) -> list[Path]:
    """`offline-run-*` dirs under `root` (`root` itself, its `wandb/`, or deeper); skips `latest-run`."""
    if Path(root).name.startswith("offline-run-"):  # one run's own directory
        return [Path(root)]
    found = glob.glob(os.path.join(os.fspath(root), "**", "offline-run-*"), recursive=True)
    return sorted(Path(p) for p in found if "latest-run" not in p and os.path.isdir(p))


def read_wandb_offline(root: str | os.PathLike[str], wait_for_exit_s: float = 10.0) -> WandbOfflineRun:
    """The one offline run under `root` (fails if there is not exactly one).

    `run.finish()` returns once wandb-core has processed the exit record, but the core writes the
    `.wandb` file asynchronously until it closes the stream (`inform_finish` is fire-and-forget in
    0.31): right after `finish` the file can still be just its 7-byte header. So wait up to
    `wait_for_exit_s` for the exit record to reach the file.
    """
    runs = find_wandb_offline_runs(root)
    assert len(runs) == 1, f"expected one offline W&B run under {root}, found {runs}"
    run_dir = runs[0]
    files = glob.glob(str(run_dir / "run-*.wandb"))
    assert len(files) == 1, f"expected one .wandb file in {run_dir}, found {files}"
    deadline = time.monotonic() + wait_for_exit_s
    while True:
        out = _parse_wandb_file(run_dir, files[0])
        if out.exited or time.monotonic() >= deadline:
            return out
        time.sleep(0.05)


def _parse_wandb_file(run_dir: Path, path: str) -> WandbOfflineRun:
    out = WandbOfflineRun(run_dir=run_dir)
    for record in iter_wandb_records(path):
        kind = record.WhichOneof("record_type")
        out.record_kinds.append(kind)
        if kind == "run":
            out.run_id = record.run.run_id
            out.name = record.run.display_name
            out.project = record.run.project
            out.group = record.run.run_group
            out.tags = list(record.run.tags)
            out.config.update(_items_to_dict(record.run.config.update))
        elif kind == "config":
            out.config.update(_items_to_dict(record.config.update))
        elif kind == "history":
            out.history.append(_items_to_dict(record.history.item))
        elif kind == "summary":
            out.summary.update(_items_to_dict(record.summary.update))
        elif kind == "metric":
            m = record.metric
            out.metric_defs.append({"name": m.name, "glob_name": m.glob_name, "step_metric": m.step_metric})
        elif kind == "exit":
            out.exited, out.exit_code = True, record.exit.exit_code
    out.config.pop("_wandb", None)
    return out


# -- MLflow ------------------------------------------------------------------------------------------


@dataclass
class MlflowRunData:
    run_id: str
    status: str
    run_name: str
    params: dict[str, str]
    metrics: dict[str, list[tuple[int, float]]]
    artifacts: dict[str, str]  # path -> text content


def read_mlflow(tracking_uri: str, experiment: str, run_name: str | None = None) -> MlflowRunData:
    """The (one, or the one named `run_name`) run of `experiment`, with full metric histories."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    exp = client.get_experiment_by_name(experiment)
    assert exp is not None, f"no MLflow experiment {experiment!r} at {tracking_uri}"
    runs = list(client.search_runs([exp.experiment_id]))
    if run_name is not None:
        runs = [r for r in runs if r.info.run_name == run_name]
    assert len(runs) == 1, f"expected one run, found {[r.info.run_name for r in runs]}"
    run = runs[0]
    run_id = run.info.run_id
    metrics = {
        key: sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
        for key in run.data.metrics
    }
    artifacts: dict[str, str] = {}

    def walk(path: str | None) -> None:
        for info in client.list_artifacts(run_id, path):
            if info.is_dir:
                walk(info.path)
            else:
                local = client.download_artifacts(run_id, info.path)
                artifacts[info.path] = Path(local).read_text(encoding="utf-8")

    walk(None)
    return MlflowRunData(
        run_id=run_id,
        status=run.info.status,
        run_name=run.info.run_name,
        params=dict(run.data.params),
        metrics=metrics,
        artifacts=artifacts,
    )
