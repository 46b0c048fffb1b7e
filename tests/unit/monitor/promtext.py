"""A tiny checker for the Prometheus text exposition format 0.0.4 (the parts the exporter uses).

`parse_prometheus(text)` returns ``{family: {"type": ..., "help": ..., "samples": [(name, labels, value)]}}``
and raises AssertionError on anything malformed: unknown lines, bad names or
label syntax, a sample before its family's TYPE, a family split in two, values
that are not numbers, histogram buckets that decrease or whose +Inf differs from _count.
"""

from __future__ import annotations

import math
import re
from typing import Any

NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
SAMPLE_RE = re.compile(rf"^({NAME})(\{{(.*)\}})? (\S+)$")
LABEL_RE = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"(,|$)')
TYPES = {"counter", "gauge", "histogram", "summary", "untyped"}


def _labels(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    pos = 0
    while pos < len(text):
        m = LABEL_RE.match(text, pos)
        assert m, f"bad labels {text!r} at {pos}"
        assert m.group(1) not in out, f"label {m.group(1)} repeated"
        out[m.group(1)] = m.group(2).replace('\\"', '"').replace("\\n", "\n").replace("\\\\", "\\")
        pos = m.end()
    return out


def _family_of(name: str, families: dict[str, Any]) -> str:
    for suffix in ("_bucket", "_sum", "_count"):
        base = name[: -len(suffix)]
        if name.endswith(suffix) and families.get(base, {}).get("type") == "histogram":
            return base
    return name


def parse_prometheus(text: str) -> dict[str, dict[str, Any]]:
    assert text.endswith("\n"), "exposition must end with a newline"
    families: dict[str, dict[str, Any]] = {}
    finished: set[str] = set()
    current: str | None = None
    for line in text.splitlines():
        if not line:
            continue
        if line.startswith("# HELP ") or line.startswith("# TYPE "):
            _, kind, name, *rest = line.split(" ", 3)
            assert re.fullmatch(NAME, name), f"bad name {name!r}"
            fam = families.setdefault(name, {"type": "untyped", "help": "", "samples": []})
            if kind == "TYPE":
                assert rest and rest[0] in TYPES, f"bad type in {line!r}"
                assert not fam["samples"], f"TYPE after samples for {name}"
                fam["type"] = rest[0]
            else:
                fam["help"] = rest[0] if rest else ""
            continue
        assert not line.startswith("#"), f"unknown comment {line!r}"
        m = SAMPLE_RE.match(line)
        assert m, f"bad sample line {line!r}"
        name, _, label_text, value_text = m.groups()
        value = float(value_text)  # accepts NaN, +Inf, -Inf
        fam_name = _family_of(name, families)
        assert fam_name in families and families[fam_name]["type"] != "untyped", f"{name} has no TYPE"
        if fam_name != current:
            assert fam_name not in finished, f"family {fam_name} split in two"
            if current is not None:
                finished.add(current)
            current = fam_name
        families[fam_name]["samples"].append((name, _labels(label_text or ""), value))
    for fam_name, fam in families.items():
        if fam["type"] != "histogram":
            continue
        buckets = [(s[1]["le"], s[2]) for s in fam["samples"] if s[0] == fam_name + "_bucket"]
        counts = [s[2] for s in fam["samples"] if s[0] == fam_name + "_count"]
        assert buckets and counts, f"histogram {fam_name} lacks buckets or count"
        bounds = [math.inf if le == "+Inf" else float(le) for le, _ in buckets]
        assert bounds == sorted(bounds) and bounds[-1] == math.inf, f"{fam_name} bucket bounds {bounds}"
        values = [v for _, v in buckets]
        assert values == sorted(values), f"{fam_name} buckets decrease: {values}"
        assert values[-1] == counts[0], f"{fam_name}: +Inf bucket {values[-1]} != count {counts[0]}"
    return families


def sample_value(families: dict[str, dict[str, Any]], name: str, **labels: str) -> float | None:
    for fam in families.values():
        for sname, slabels, value in fam["samples"]:
            if sname == name and all(slabels.get(k) == v for k, v in labels.items()):
                return float(value)
    return None
