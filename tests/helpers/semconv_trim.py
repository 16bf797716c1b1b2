"""Trim the OTel hardware semantic conventions to what tests/hardware/test_semconv.py checks.

    python tests/helpers/semconv_trim.py <semantic-conventions checkout>/model/hardware <tag> <commit> \\
        > tests/data/semconv_hw.yaml

Reads every `model/hardware/*.yaml` (weaver definition/2), resolves the attribute groups and writes,
per `hw.*` metric: instrument, unit, the attributes it requires and those it requires on a
condition; `metric_refinements` that pin an attribute's value (`hw.type` MUST be `gpu`) are kept
as `values`.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import yaml


def _groups(docs: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    return {g["id"]: g.get("attributes", []) for d in docs for g in d.get("attribute_groups", []) or []}


def _resolve(attributes: list[dict[str, Any]], groups: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """attribute -> requirement level, ref_groups expanded (a later entry overrides an earlier one)."""
    out: dict[str, Any] = {}
    for attr in attributes:
        if "ref_group" in attr:
            out.update(_resolve(groups[attr["ref_group"]], groups))
        elif "ref" in attr:
            out[attr["ref"]] = attr.get("requirement_level", out.get(attr["ref"], "recommended"))
    return out


def trim(directory: Path, tag: str, commit: str) -> dict[str, Any]:
    docs = [yaml.safe_load(p.read_text()) for p in sorted(directory.glob("*.yaml"))]
    groups = _groups(docs)
    metrics: dict[str, Any] = {}
    for doc in docs:
        for metric in doc.get("metrics", []) or []:
            levels = _resolve(metric.get("attributes", []), groups)
            metrics[metric["name"]] = {
                "instrument": metric["instrument"],
                "unit": metric["unit"],
                "required": sorted(a for a, level in levels.items() if level == "required"),
                "conditionally_required": sorted(
                    a
                    for a, level in levels.items()
                    if isinstance(level, dict) and "conditionally_required" in level
                ),
            }
    refinements: dict[str, Any] = {}
    for doc in docs:
        for ref in doc.get("metric_refinements", []) or []:
            for attr in ref.get("attributes", []):
                match = re.search(r"MUST be set to `([^`]+)`", attr.get("note", ""))
                if "ref" in attr and match:
                    refinements.setdefault(ref["id"], {"metric": ref["ref"], "values": {}})
                    refinements[ref["id"]]["values"][attr["ref"]] = match.group(1)
    return {
        "source": {"repository": "open-telemetry/semantic-conventions", "tag": tag, "commit": commit,
                   "files": "model/hardware/*.yaml"},
        "metrics": dict(sorted(metrics.items())),
        "refinements": dict(sorted(refinements.items())),
    }  # fmt: skip


if __name__ == "__main__":
    data = trim(Path(sys.argv[1]), sys.argv[2], sys.argv[3])
    header = (
        f"# The OTel hardware semantic conventions ({data['source']['tag']}), trimmed by\n"
        "# tests/helpers/semconv_trim.py to what tests/hardware/test_semconv.py checks. Do not edit by hand.\n"
    )
    sys.stdout.write(header + yaml.safe_dump(data, sort_keys=False, width=110))
