"""The alert line's schema, as data: a JSON Schema dict (:data:`ALERT_SCHEMA`) and :func:`validate_alert`.

One alert is one JSON object (a line of ``stable_attn_alerts.jsonl``, a webhook body): what
:meth:`~stable_attn.monitor.alerts.alert.Alert.to_dict` writes. docs/ALERTS.md documents every field; this module
is its machine form, which the tests and ``stable-attn report`` check lines against.

Versions: a line without ``version`` is version 1 (the fields of 0.1 to 0.x: step, kind, metric, value,
baseline, threshold, score, lr, layers, action, message, checkpoint, time). Version 2 (:data:`VERSION`)
adds the evidence fields (:data:`EVIDENCE`): ``version`` itself, ``data_position``, ``lrs``,
``world_size``, ``ranks``, ``loss_window``, ``attention``, ``grad_norms`` and ``outcome``, each may be
null. A field added later is one line in :data:`EVIDENCE` (and one field of ``Alert``).

Floats: a number, or one of the strings ``"nan"``, ``"inf"``, ``"-inf"`` (strict JSON has no NaN or
Infinity). The list caps (:data:`CAPS`) bound a line; the webhook's body has its own, smaller ones
(:data:`REMOTE_CAPS`).

The validator covers the subset of JSON Schema this schema uses (``type``, ``enum``, ``properties``,
``required``, ``additionalProperties``, ``items``, ``prefixItems``, ``minItems``, ``maxItems``,
``minimum``, ``anyOf``, ``$ref`` to ``#/$defs/...``); no jsonschema dependency. Pure Python.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..names import ALERT_KINDS

__all__ = ["ALERT_SCHEMA", "CAPS", "EVIDENCE", "REMOTE_CAPS", "VERSION", "AlertSchemaError", "alert_version",
           "check_field", "validate_alert"]

#: The version :meth:`Alert.to_dict` writes.
VERSION = 2

#: Most entries a line holds in each list field (JSONL file and webhook alike); what the engine collects.
CAPS = {"lrs": 16, "ranks": 16, "loss_window": 32, "attention.layers": 64, "grad_norms.top": 5}
#: Most entries a webhook body holds (:meth:`Alert.for_remote` cuts the lists to these).
REMOTE_CAPS = {"lrs": 4, "ranks": 8, "loss_window": 32, "attention.layers": 8, "grad_norms.top": 5}

_NUM = {"type": "number"}
_FLOAT = {"anyOf": [_NUM, {"enum": ["nan", "inf", "-inf"]}]}
_NULL = {"type": "null"}


def _nullable(schema: Mapping[str, Any]) -> dict[str, Any]:
    return {"anyOf": [dict(schema), _NULL]}


def _object(properties: Mapping[str, Any], required: tuple[str, ...] | None = None) -> dict[str, Any]:
    return {"type": "object", "properties": dict(properties),
            "required": list(properties if required is None else required), "additionalProperties": False}


_OPT_FLOAT = {"$ref": "#/$defs/optional_float"}
_NAMED_FLOAT = {"type": "array", "prefixItems": [{"type": "string"}, {"$ref": "#/$defs/float"}], "minItems": 2,
                "maxItems": 2}  # [name, float]
_READING = _object({  # one rank's value of one watched metric and its detector's reading at the step
    "value": _OPT_FLOAT,
    "baseline": _OPT_FLOAT,  # the detector's forecast before the value (null before its first value)
    "score": _OPT_FLOAT,  # null unless the detector flagged the value
    "threshold": _OPT_FLOAT,
    "rule": _nullable({"type": "string"}),
})
_LAYER_STATS = _object({
    "layer": {"type": "string"},
    "max_logit": _OPT_FLOAT,
    "saturation": _OPT_FLOAT,
    "sink_mass": _OPT_FLOAT,
    "entropy": _OPT_FLOAT,  # null where the step collected no entropy
    "fixed_rate": _OPT_FLOAT,
})
_MOVED = _object({
    "layer": {"type": "string"},
    "stat": {"enum": ["max_logit", "saturation", "sink_mass", "entropy"]},
    "from_step": {"type": "integer"},
    "to_step": {"type": "integer"},
    "before": {"$ref": "#/$defs/float"},
    "after": {"$ref": "#/$defs/float"},
    "relative_change": {"$ref": "#/$defs/float"},
    "head": _nullable({"type": "integer", "minimum": 0}),
    "head_before": _OPT_FLOAT,
    "head_after": _OPT_FLOAT,
    "head_relative_change": _OPT_FLOAT,
})

#: The version-2 fields: name -> schema. Each may be null (unknown, or not collected for this alert).
EVIDENCE: dict[str, dict[str, Any]] = {
    "version": {"type": "integer", "minimum": 1},
    "data_position": _nullable(_object({
        "epoch": _nullable({"type": "integer", "minimum": 0}),
        "batch_index": _nullable({"type": "integer", "minimum": 0}),
        "fingerprint": _nullable({"type": "string"}),
    })),
    "lrs": _nullable({"type": "array", "items": _OPT_FLOAT, "maxItems": CAPS["lrs"]}),
    "world_size": _nullable({"type": "integer", "minimum": 1}),
    "ranks": _nullable({"type": "array", "maxItems": CAPS["ranks"], "items": _object({
        "rank": {"type": "integer", "minimum": 0},
        "loss": _nullable(_READING),
        "grad_norm": _nullable(_READING),
    })}),
    "loss_window": _nullable({"type": "array", "maxItems": CAPS["loss_window"], "items": {
        "type": "array", "prefixItems": [{"type": "integer"}, {"$ref": "#/$defs/float"}],
        "minItems": 2, "maxItems": 2}}),
    "attention": _nullable(_object({
        "step": {"type": "integer", "minimum": 0},
        "window": {"type": "integer", "minimum": 1},
        "layers": {"type": "array", "items": _LAYER_STATS, "maxItems": CAPS["attention.layers"]},
        "layers_total": {"type": "integer", "minimum": 0},
        "moved": _nullable(_MOVED),
    })),
    "grad_norms": _nullable(_object({
        "scope": {"enum": ["global", "local"]},
        "parameters": {"type": "integer", "minimum": 0},
        "top": {"type": "array", "maxItems": CAPS["grad_norms.top"], "items": _NAMED_FLOAT},
    })),
    "outcome": _nullable(_object({
        "taken": {"type": "string"},
        "update_applied": _nullable({"type": "boolean"}),
        "rolled_back_to": _nullable({"type": "integer", "minimum": 0}),
        "skipping_batches": _nullable({"type": "array", "prefixItems": [{"type": "integer"}, {"type": "integer"}],
                                       "minItems": 2, "maxItems": 2}),
        "stopped": {"type": "boolean"},
        "checkpoint": _nullable({"type": "string"}),
    })),
    # diagnose_spikes (monitor/actions/replay.py): each variant's loss and gradient norm and the verdict, or why none
    "diagnosis": _nullable({"type": "object", "properties": {
        "verdict": {"enum": ["numerical", "data", "unclear"]},
        "metric": {"enum": ["loss", "grad_norm"]},
        "run_variant": {"type": "string"},
        "variants": {"type": "object"},
        "bundle": {"type": "string"},
        "skipped": {"type": "string"},
        "error": {"type": "string"},
    }}),
}

#: The version-1 fields (every line has them; hand-written lines may lack some, which the report tolerates).
_V1: dict[str, dict[str, Any]] = {
    "step": {"type": "integer", "minimum": 0},
    "kind": {"enum": list(ALERT_KINDS)},
    "metric": {"type": "string"},
    "value": {"$ref": "#/$defs/float"},
    "baseline": {"$ref": "#/$defs/float"},
    "threshold": {"$ref": "#/$defs/float"},
    "score": {"$ref": "#/$defs/float"},
    "lr": _OPT_FLOAT,
    "layers": {"type": "array", "items": _NAMED_FLOAT},
    "action": {"type": "string"},
    "message": {"type": "string"},
    "checkpoint": _nullable({"type": "string"}),
    "time": _NUM,
}

#: The JSON Schema of one alert line, version :data:`VERSION` (version 1 lines: the same without :data:`EVIDENCE`).
ALERT_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "stable_attn alert",
    "type": "object",
    "$defs": {"float": _FLOAT, "optional_float": {"anyOf": [_NUM, {"enum": ["nan", "inf", "-inf"]}, _NULL]}},
    "properties": {**_V1, **EVIDENCE},
    "required": [*_V1, *EVIDENCE],
    "additionalProperties": True,  # a reader keeps keys it does not know (a newer writer's)
}


class AlertSchemaError(ValueError):
    """An alert object that does not match :data:`ALERT_SCHEMA`; ``field`` is the path of the first bad field
    (``ranks[1].loss.baseline``)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"alert field {field or '(the object)'!r}: {message}")
        self.field = field


def alert_version(obj: Mapping[str, Any]) -> int:
    """The schema version of an alert object: its ``version``, or 1 when it has none."""
    version = obj.get("version", 1)
    return version if isinstance(version, int) and not isinstance(version, bool) else 1


def validate_alert(obj: Any) -> int:
    """Check one alert object (a parsed JSONL line, a webhook body) against the schema of its version; return
    the version. A line without ``version`` is checked as version 1 (the v1 fields only). AlertSchemaError
    names the first field that does not match, what it holds and what is accepted."""
    if not isinstance(obj, Mapping):
        raise AlertSchemaError("", f"is a {type(obj).__name__}, not a JSON object")
    if "version" in obj and (not isinstance(obj["version"], int) or isinstance(obj["version"], bool)
                             or obj["version"] < 1):
        raise AlertSchemaError("version", f"is {obj['version']!r}; use an integer >= 1")
    version = alert_version(obj)
    schema = ALERT_SCHEMA if version >= 2 else {**ALERT_SCHEMA, "properties": _V1, "required": list(_V1)}
    _check(obj, schema, "")
    return version


def check_field(name: str, value: Any) -> None:
    """Check one field of an alert object against its schema (AlertSchemaError naming it); a name the schema
    does not know is accepted (a newer writer's field)."""
    schema = ALERT_SCHEMA["properties"].get(name)
    if schema is not None:
        _check(value, schema, name)


_TYPES = {"object": Mapping, "array": (list, tuple), "string": str, "boolean": bool, "null": type(None)}


def _is_type(value: Any, name: str) -> bool:
    if name == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if name == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, _TYPES[name])


def _resolve(schema: Mapping[str, Any]) -> Mapping[str, Any]:
    ref = schema.get("$ref")
    if ref is None:
        return schema
    return ALERT_SCHEMA["$defs"][ref.rpartition("/")[2]]


def _describe(schema: Mapping[str, Any]) -> str:
    schema = _resolve(schema)
    if "anyOf" in schema:
        return " or ".join(_describe(s) for s in schema["anyOf"])
    if "enum" in schema:
        return "one of " + ", ".join(map(repr, schema["enum"]))
    return schema.get("type", "a value")


def _check(value: Any, schema: Mapping[str, Any], path: str) -> None:
    schema = _resolve(schema)
    if "anyOf" in schema:
        for option in schema["anyOf"]:
            try:
                _check(value, option, path)
                return
            except AlertSchemaError:
                kind = _resolve(option).get("type")
                if kind is not None and _is_type(value, kind):  # the value has this option's type: say what is wrong
                    raise
        raise AlertSchemaError(path, f"is {_shown(value)}; use {_describe(schema)}")
    if "enum" in schema and value not in schema["enum"]:
        raise AlertSchemaError(path, f"is {_shown(value)}; use one of {', '.join(map(repr, schema['enum']))}")
    kind = schema.get("type")
    if kind is not None and not _is_type(value, kind):
        raise AlertSchemaError(path, f"is {_shown(value)}; use {kind}")
    if "minimum" in schema and value < schema["minimum"]:
        raise AlertSchemaError(path, f"is {value!r}; use a value >= {schema['minimum']}")
    if kind == "object":
        for name in schema.get("required", ()):
            if name not in value:
                raise AlertSchemaError(_join(path, name), "is missing")
        properties = schema.get("properties", {})
        for name, item in value.items():
            if name in properties:
                _check(item, properties[name], _join(path, name))
            elif schema.get("additionalProperties", True) is False:
                raise AlertSchemaError(_join(path, str(name)), f"is not a field here; use {', '.join(properties)}")
    if kind == "array":
        if len(value) > schema.get("maxItems", len(value)):
            raise AlertSchemaError(path, f"holds {len(value)} entries; at most {schema['maxItems']}")
        if len(value) < schema.get("minItems", 0):
            raise AlertSchemaError(path, f"holds {len(value)} entries; at least {schema['minItems']}")
        prefix = schema.get("prefixItems", [])
        for i, item in enumerate(value):
            if i < len(prefix):
                _check(item, prefix[i], f"{path}[{i}]")
            elif "items" in schema:
                _check(item, schema["items"], f"{path}[{i}]")


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
