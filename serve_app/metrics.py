"""Cluster metrics: the replicas' pushed engine stats, summed, and written as Prometheus text.

Owns the shape of GET /v1/stats (per-replica figures and cluster-wide totals) and of GET /metrics
(Prometheus text format 0.0.4: `rwkv_replica_*{replica="..."}` per replica and `rwkv_*` for the
cluster; the engines' request histograms (replicas/histograms.py) as Prometheus histograms, their
buckets summed for the cluster). Never touches Ray or the engine: it reads what the registry returns.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_HELP = {
    "slots_capacity": "slots (sequences in flight at once)",
    "slots_idle": "slots holding no request",
    "slots_wait": "slots prefilling a prompt",
    "slots_busy": "slots generating",
    "waiting": "requests queued for a slot",
    "running": "requests holding a slot",
    "submitted": "requests accepted",
    "generated_tokens": "tokens generated",
    "prefilled_tokens": "prompt tokens run through the model",
    "continued_tokens": "prompt tokens skipped by continuing an idle slot",
    "busy_refusals": "requests refused because the waiting queue was full",
    "preempted": "requests parked to give their slot to a more urgent one (they go on later)",
    "drafted_tokens": "speculative decoding: tokens guessed from a request's own earlier tokens and fed",
    "accepted_drafts": "speculative decoding: guessed tokens that sampling kept (each saved a model call)",
    "followed_prompts": "requests that waited for another's prompt state instead of prefilling it beside it",
    "json_mode_requests": "requests in JSON mode (a JSON object, a schema's, or a tool call)",
    "pattern_requests": "requests whose reply a pattern constrains (structured outputs' regex or choice)",
    "json_masks_made": "JSON mode and patterns: banned-token masks made (one a new state of a constraint)",
    "json_mask_us": "JSON mode and patterns: microseconds the engine spent making masks",
    "cache_lookups": "prefix-cache lookups",
    "cache_hits": "prefix-cache hits",
    "cache_misses": "prefix-cache misses",
    "cache_hit_tokens": "prompt tokens whose state came from the prefix cache",
    "states_moved_in": "prefix states taken from other replicas",
    "state_tokens_moved_in": "prompt tokens whose state was taken from another replica",
    "states_moved_out": "prefix states given to other replicas",
    "state_move_failures": "prefix states asked of another replica and not taken (prefilled instead)",
    "cache_device_bytes": "prefix-cache bytes in device memory",
    "cache_host_bytes": "prefix-cache bytes in host memory",
    "cache_disk_bytes": "prefix-cache bytes in files (the disk tier)",
    "cache_disk_writes": "prefix states the disk tier took (a file each)",
    "cache_disk_reads": "prefix states read back from the disk tier",
    "cache_disk_drops": "prefix states the disk tier had room for and did not keep (write queue full, write failed)",
}
_GAUGE_SUFFIXES = ("_bytes", "_entries")
_HISTOGRAM_HELP = {
    "request_queue_seconds": "seconds from a request's arrival at its engine to a slot",
    "time_to_first_token_seconds": "seconds from a request's arrival at its engine to its first token",
    "inter_token_seconds": "seconds between two tokens of a request",
    "request_seconds": "seconds from a request's arrival at its engine to its end (any reason)",
    "request_prompt_tokens": "prompt tokens of a request",
    "request_generated_tokens": "tokens a request generated",
}


def stats_view(replicas: dict[str, dict], catalog_version: int, responses: dict[str, int] | None = None) -> dict:
    """The JSON of /v1/stats: each live replica's stats and their sum, and the Responses API's
    store (the registry's response_store)."""
    per_replica = {name: {**r["stats"], "acked_version": r["acked_version"], "age_s": r["age_s"]}
                   for name, r in sorted(replicas.items())}
    total = sum_stats(r["stats"] for r in replicas.values())
    return {"object": "stats", "catalog_version": catalog_version, "replica_count": len(replicas),
            "replicas": per_replica, "total": total, "stored_responses": responses or {}}


def sum_stats(stats: Iterable[dict]) -> dict:
    """Numbers summed key by key through nested dicts; anything else (lists, text) is left out."""
    total: dict[str, Any] = {}
    for one in stats:
        _add(total, one)
    return total


def _add(total: dict, one: dict) -> None:
    for key, value in one.items():
        if isinstance(value, dict):
            _add(total.setdefault(key, {}), value)
        elif isinstance(value, int | float) and not isinstance(value, bool):
            total[key] = total.get(key, 0) + value


def prometheus_text(replicas: dict[str, dict], catalog_version: int, responses: dict[str, int] | None = None) -> str:
    lines = [
        "# HELP rwkv_replicas live model replicas (pushed metrics recently)",
        "# TYPE rwkv_replicas gauge",
        f"rwkv_replicas {len(replicas)}",
        "# HELP rwkv_init_state_catalog_version version of the init-state catalog",
        "# TYPE rwkv_init_state_catalog_version gauge",
        f"rwkv_init_state_catalog_version {catalog_version}",
    ]
    for key, value in (responses or {}).items():  # the Responses API's store, in the registry
        lines += [f"# HELP rwkv_stored_responses_{key} stored responses: {key.replace('_', ' ')}",
                  f"# TYPE rwkv_stored_responses_{key} gauge", f"rwkv_stored_responses_{key} {value}"]
    flat = {name: _flatten(r["stats"]) for name, r in sorted(replicas.items())}
    totals = _flatten(sum_stats(r["stats"] for r in replicas.values()))
    keys = sorted(set(totals).union(*flat.values())) if flat else []
    for key in keys:
        kind = "counter" if _is_counter(key) else "gauge"
        suffix = "_total" if kind == "counter" else ""
        help_text = _HELP.get(key, key.replace("_", " "))
        lines += [f"# HELP rwkv_replica_{key}{suffix} {help_text}, per replica",
                  f"# TYPE rwkv_replica_{key}{suffix} {kind}"]
        lines += [f'rwkv_replica_{key}{suffix}{{replica="{_label(name)}"}} {_number(values.get(key, 0))}'
                  for name, values in flat.items()]
        lines += [f"# HELP rwkv_{key}{suffix} {help_text}, all replicas", f"# TYPE rwkv_{key}{suffix} {kind}",
                  f"rwkv_{key}{suffix} {_number(totals.get(key, 0))}"]
    lines += _histogram_lines(replicas)
    return "\n".join(lines) + "\n"


def _histogram_lines(replicas: dict[str, dict]) -> list[str]:
    """Each histogram per replica (`rwkv_replica_<name>_bucket{replica=,le=}`, `_sum`, `_count`) and
    for the cluster (`rwkv_<name>_...`, the replicas' buckets summed)."""
    per_replica = {name: r["stats"].get("histograms", {}) for name, r in sorted(replicas.items())}
    totals = sum_stats(per_replica.values())
    lines = []
    for key in sorted(totals):
        help_text = _HISTOGRAM_HELP.get(key, key.replace("_", " "))
        lines += [f"# HELP rwkv_replica_{key} {help_text}, per replica", f"# TYPE rwkv_replica_{key} histogram"]
        for name, histograms in per_replica.items():
            if key in histograms:
                lines += _histogram(f"rwkv_replica_{key}", histograms[key], f'replica="{_label(name)}",')
        lines += [f"# HELP rwkv_{key} {help_text}, all replicas", f"# TYPE rwkv_{key} histogram"]
        lines += _histogram(f"rwkv_{key}", totals[key], "")
    return lines


def _histogram(name: str, histogram: dict, labels: str) -> list[str]:
    lines = [f'{name}_bucket{{{labels}le="{le}"}} {_number(n)}' for le, n in histogram["buckets"].items()]
    plain = f"{{{labels[:-1]}}}" if labels else ""
    return [*lines, f"{name}_sum{plain} {_number(histogram['sum'])}",
            f"{name}_count{plain} {_number(histogram['count'])}"]


def _flatten(stats: dict) -> dict[str, float]:
    """{"slots": {"busy": 1}, "counters": {"submitted": 3}, "cache": {"hits": 2}} ->
    {"slots_busy": 1, "submitted": 3, "cache_hits": 2} (counters lose their group name)."""
    flat: dict[str, float] = {}
    for key, value in stats.items():
        if key == "histograms":
            continue  # written as histograms (_histogram_lines)
        if isinstance(value, dict):
            prefix = "" if key == "counters" else f"{key}_"
            flat.update({f"{prefix}{k}": v for k, v in _flatten(value).items()})
        elif isinstance(value, int | float) and not isinstance(value, bool):
            flat[key] = value
    return {_metric_name(k): v for k, v in flat.items()}


def _is_counter(key: str) -> bool:
    gauges = ("slots_", "waiting", "running", "age_s", "acked_version")
    if key.startswith(gauges):
        return False
    return not key.endswith(_GAUGE_SUFFIXES)


def _metric_name(key: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", key)


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))
