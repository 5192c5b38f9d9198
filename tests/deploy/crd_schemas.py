"""Schemas of the custom resources deploy/ uses, for the offline check (kubernetes-validate knows only
the built-in kinds). Written from the fields the Prometheus Operator (monitoring.coreos.com/v1) and
KEDA (keda.sh/v1alpha1) document for these kinds, limited to what a mistake in our manifests could
break: required fields, types, and no unknown keys where we write them."""

from __future__ import annotations

from typing import Any

_METADATA: dict[str, Any] = {
    "type": "object", "required": ["name"],
    "properties": {"name": {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"},
                   "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                   "namespace": {"type": "string"}, "annotations": {"type": "object"}},
}
_SELECTOR: dict[str, Any] = {
    "type": "object", "additionalProperties": False,
    "properties": {"matchLabels": {"type": "object", "additionalProperties": {"type": "string"}},
                   "matchExpressions": {"type": "array"}},
}
_SECRET_KEY = {"type": "object", "required": ["name", "key"], "additionalProperties": False,
               "properties": {"name": {"type": "string"}, "key": {"type": "string"},
                              "optional": {"type": "boolean"}}}
_DURATION = {"type": "string", "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"}


def _object(api_version: str, kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "required": ["apiVersion", "kind", "metadata", "spec"], "additionalProperties": False,
            "properties": {"apiVersion": {"const": api_version}, "kind": {"const": kind}, "metadata": _METADATA,
                           "spec": spec}}


SERVICE_MONITOR = _object("monitoring.coreos.com/v1", "ServiceMonitor", {
    "type": "object", "required": ["selector", "endpoints"], "additionalProperties": False,
    "properties": {
        "selector": _SELECTOR,
        "namespaceSelector": {"type": "object"},
        "jobLabel": {"type": "string"},
        "endpoints": {"type": "array", "minItems": 1, "items": {
            "type": "object", "additionalProperties": False,
            "properties": {
                "port": {"type": "string"}, "targetPort": {}, "path": {"type": "string"}, "scheme": {"enum": ["http", "https"]},
                "interval": _DURATION, "scrapeTimeout": _DURATION, "honorLabels": {"type": "boolean"},
                "authorization": {"type": "object", "additionalProperties": False,
                                  "properties": {"type": {"type": "string"}, "credentials": _SECRET_KEY}},
                "relabelings": {"type": "array"}, "metricRelabelings": {"type": "array"},
            }}},
    },
})

_RULE = {
    "type": "object", "required": ["expr"], "additionalProperties": False,
    "oneOf": [{"required": ["alert"], "not": {"required": ["record"]}}, {"required": ["record"], "not": {"required": ["alert"]}}],
    "properties": {
        "alert": {"type": "string", "pattern": "^[A-Za-z_][A-Za-z0-9_]*$"},
        "record": {"type": "string", "pattern": "^[a-zA-Z_:][a-zA-Z0-9_:]*$"},
        "expr": {"type": "string", "minLength": 1}, "for": _DURATION, "keep_firing_for": _DURATION,
        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
        "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
    },
}
PROMETHEUS_RULE = _object("monitoring.coreos.com/v1", "PrometheusRule", {
    "type": "object", "required": ["groups"], "additionalProperties": False,
    "properties": {"groups": {"type": "array", "minItems": 1, "items": {
        "type": "object", "required": ["name", "rules"], "additionalProperties": False,
        "properties": {"name": {"type": "string"}, "interval": _DURATION,
                       "rules": {"type": "array", "minItems": 1, "items": _RULE}}}}},
})

SCALED_OBJECT = _object("keda.sh/v1alpha1", "ScaledObject", {
    "type": "object", "required": ["scaleTargetRef", "triggers"], "additionalProperties": False,
    "properties": {
        "scaleTargetRef": {"type": "object", "required": ["name"], "additionalProperties": False,
                           "properties": {"apiVersion": {"type": "string"}, "kind": {"type": "string"},
                                          "name": {"type": "string"}, "envSourceContainerName": {"type": "string"}}},
        "minReplicaCount": {"type": "integer", "minimum": 0}, "maxReplicaCount": {"type": "integer", "minimum": 1},
        "idleReplicaCount": {"type": "integer"}, "pollingInterval": {"type": "integer", "minimum": 1},
        "cooldownPeriod": {"type": "integer", "minimum": 0}, "initialCooldownPeriod": {"type": "integer"},
        "fallback": {"type": "object"},
        "advanced": {"type": "object", "additionalProperties": False, "properties": {
            "restoreToOriginalReplicaCount": {"type": "boolean"},
            "scalingModifiers": {"type": "object"},
            "horizontalPodAutoscalerConfig": {"type": "object", "additionalProperties": False, "properties": {
                "name": {"type": "string"}, "behavior": {"type": "object"}}}}},
        "triggers": {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["type", "metadata"], "additionalProperties": False,
            "properties": {"type": {"type": "string"}, "name": {"type": "string"},
                           "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
                           "useCachedMetrics": {"type": "boolean"},
                           "metadata": {"type": "object", "additionalProperties": {"type": "string"}},
                           "authenticationRef": {"type": "object"}}}},
    },
})

CUSTOM = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): SERVICE_MONITOR,
    ("monitoring.coreos.com/v1", "PrometheusRule"): PROMETHEUS_RULE,
    ("keda.sh/v1alpha1", "ScaledObject"): SCALED_OBJECT,
}
