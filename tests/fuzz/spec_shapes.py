"""ElasticTrainingJob specs shaped by the CRD's own schema (crds/), each choice made by fuzzer bytes.

The API server refuses a spec its structural schema rejects and fills in every `default`, so the operator only
ever sees such specs: this builds one the same way (types, enums, bounds, lengths, item counts, required fields,
defaults), leaving the CEL rules (`x-kubernetes-validations`) unapplied, as an API server without them would.
"""

from __future__ import annotations

import datetime
import pathlib
from typing import Any

import yaml

from sneppx_operator import reconcile

CRD = pathlib.Path(__file__).resolve().parents[2] / "crds" / "sneppx.io_elastictrainingjobs.yaml"
SPEC_SCHEMA = yaml.safe_load(CRD.read_text())["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
STRINGS = ["", "a", "trainer", "ckpt", "example.org/t:1", "s3://bucket/prefix", "/data", "0", "-1", "1Gi", "500m",
           "Always", "RestartGroup", "Pause", "Fail", "ÿé", "a" * 253, "../x", "x/y", "0.5", "1e3", "true"]
INTEGERS = [0, 1, 2, 3, -1, 7, 100, 1000, 2**31 - 1, 2**53, 2**63 - 1, -(2**63)]
NUMBERS = [0.0, 0.5, 1.0, -1.0, 1e-9, 1e9, 3.25]


class Choices:
    """Decisions read from the input bytes in order; zeros once they run out (so every input is a spec)."""

    def __init__(self, data: bytes):
        self.data, self.at = data, 0

    def below(self, n: int) -> int:
        if n <= 1:
            return 0
        byte = self.data[self.at] if self.at < len(self.data) else 0
        self.at += 1
        return byte % n

    def pick(self, options: list[Any]) -> Any:
        return options[self.below(len(options))]


def value(schema: dict[str, Any], c: Choices, depth: int = 0) -> Any:
    if "enum" in schema:
        return c.pick(schema["enum"])
    kind = schema.get("type")
    if kind == "object" or "properties" in schema:
        return _object(schema, c, depth)
    if kind == "array":
        low = schema.get("minItems", 0)
        high = max(low, min(schema.get("maxItems", 3), 3))
        return [value(schema.get("items", {}), c, depth + 1) for _ in range(low + c.below(high - low + 1))]
    if kind == "string" or schema.get("x-kubernetes-int-or-string"):
        text = c.pick(STRINGS)
        return text[:schema["maxLength"]] if "maxLength" in schema else text
    if kind == "integer":
        low, high = schema.get("minimum", -(2**63)), schema.get("maximum", 2**63 - 1)
        return min(max(c.pick([*INTEGERS, low, high, low + 1]), low), high)
    if kind == "number":
        low, high = schema.get("minimum", -1e18), schema.get("maximum", 1e18)
        return min(max(c.pick([*NUMBERS, low, high]), low), high)
    if kind == "boolean":
        return bool(c.below(2))
    return c.pick([None, 0, "x", [], {}])  # no type: anything (preserved unknown fields)


def _object(schema: dict[str, Any], c: Choices, depth: int) -> dict[str, Any]:
    required = set(schema.get("required", []))
    out: dict[str, Any] = {}
    for name, sub in schema.get("properties", {}).items():
        if name in required or (depth < 8 and c.below(2)):
            out[name] = value(sub, c, depth + 1)
        elif "default" in sub:
            out[name] = sub["default"]  # the API server fills it in
    extra = schema.get("additionalProperties")
    if isinstance(extra, dict) and not schema.get("properties"):
        for i in range(c.below(min(schema.get("maxProperties", 3), 3) + 1)):
            out[f"{c.pick(STRINGS[:6])}{i}"] = value(extra, c, depth + 1)
    return out


def spec_from_bytes(data: bytes) -> dict[str, Any]:
    return value(SPEC_SCHEMA, Choices(data))


def plan_first_pass(spec: dict[str, Any], *, now: datetime.datetime) -> reconcile.Plan:
    """The operator's first pass over a new job with this spec: no pods yet, no status."""
    job = reconcile.Job(name="train", namespace="ns", uid="uid-1", generation=1, spec=spec, status={})
    return reconcile.plan(job, [], now=now, heartbeat_key=b"k" * 32)
