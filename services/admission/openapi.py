"""The OpenAPI 3.1 description of the HTTP API, generated from the msgspec types."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import msgspec

from gpusched.libs.common.schemas import (
    JobProgressEvent,
    JobSpec,
    JobState,
    JobStateEvent,
    SizeErrorReport,
)
from gpusched.services.admission import history, params
from gpusched.services.admission.ids import JOB_ID
from gpusched.services.admission.problems import PROBLEM_CONTENT_TYPE, Problem
from gpusched.services.admission.specs import ACCEPTED_TYPES, ARGUMENT_PATTERN, TEXT_PATTERN
from gpusched.services.admission.views import (
    ClusterView,
    Health,
    JobDetail,
    JobList,
    SubmittedJob,
)

_REF = "#/components/schemas/{name}"


def _ref(name: str) -> dict[str, str]:
    return {"$ref": _REF.format(name=name)}


def _problem(description: str, **headers: dict[str, Any]) -> dict[str, Any]:
    problem: dict[str, Any] = {
        "description": description,
        "content": {PROBLEM_CONTENT_TYPE: {"schema": _ref("Problem")}},
    }
    if headers:
        problem["headers"] = {name.replace("_", "-"): header for name, header in headers.items()}
    return problem


def _json(description: str, schema: dict[str, Any], **extra: Any) -> dict[str, Any]:
    content = {"application/json": {"schema": schema}}
    return {"description": description, "content": content, **extra}


_JOB_ID_SCHEMA = {"type": "string", "pattern": JOB_ID.pattern}
_JOB_ID = {
    "name": "id",
    "in": "path",
    "required": True,
    "description": "A job id; anything else is a 404",
    "schema": _JOB_ID_SCHEMA,
}
_UNAUTHORIZED = _problem(
    "Missing or unknown bearer token",
    WWW_Authenticate={"schema": {"type": "string", "const": 'Bearer realm="gpusched"'}},
)
_NOT_FOUND = _problem("No such job for this tenant")
#: Retry-After: 1 while NATS is not reachable, 5 while the store takes no writes
_RETRY_AFTER = {"schema": {"type": "string", "enum": ["1", "5"]}}
_UNAVAILABLE = _problem(
    "NATS is not reachable (nats-unavailable), or the store did not take the write: full "
    "(store-full), no answer (store-unavailable), refused (store-unwritable); the detail "
    "says whether anything was stored",
    Retry_After=_RETRY_AFTER,
)
_LOCATION = {
    "Location": {
        "schema": {"type": "string", "pattern": f"^/v1/jobs/{JOB_ID.pattern[1:]}"},
        "description": "/v1/jobs/<id>",
    }
}


#: what a client can do next with the job a submission created
_JOB_LINKS = {
    name: {"operationId": operation, "parameters": {"id": "$response.body#/id"}}
    for name, operation in (
        ("GetJob", "getJob"),
        ("CancelJob", "cancelJob"),
        ("FollowJob", "jobEvents"),
    )
}


def _event(name: str, data: str) -> dict[str, Any]:
    return {
        "properties": {
            "event": {"const": name},
            "data": {"contentMediaType": "application/json", "contentSchema": _ref(data)},
        }
    }


#: one server-sent event, as OpenAPI 3.2 spells an item of ``text/event-stream`` (and as
#: the ``schema`` of a stream is read before 3.2): its ``event`` name and ``data`` line
_SERVER_SENT_EVENT = {
    "type": "object",
    "required": ["event", "data"],
    "properties": {
        "event": {"type": "string", "enum": ["job", "state", "progress"]},
        "data": {"type": "string", "contentMediaType": "application/json"},
        "id": {"type": "string"},
        "retry": {"type": "integer"},
    },
    "oneOf": [
        _event("job", "JobDetail"),
        _event("state", "JobStateEvent"),
        _event("progress", "JobProgressEvent"),
    ],
}


def build_openapi(models: Iterable[str] = (), version: str = "0.1.0") -> dict[str, Any]:
    """The document; ``models`` become the ``enum`` of a job spec's ``model``."""
    _, components = msgspec.json.schema_components(
        [JobSpec, JobDetail, SubmittedJob, JobList, ClusterView, Problem, Health,
         JobStateEvent, JobProgressEvent, SizeErrorReport, history.HistoryExport],
        ref_template=_REF,
    )
    names = sorted(models)
    if names:
        components["JobSpec"]["properties"]["model"]["enum"] = names
    spec_fields = components["JobSpec"]["properties"]
    # the patterns admission checks beyond the type (specs.check_text): records stored
    # before them must still decode, so they are not on the type itself
    spec_fields["name"]["pattern"] = TEXT_PATTERN
    labels = spec_fields["labels"]
    labels["propertyNames"]["pattern"] = TEXT_PATTERN
    labels["additionalProperties"]["pattern"] = TEXT_PATTERN
    for choice in spec_fields["command"]["anyOf"]:
        if choice.get("type") == "array":
            choice["items"]["pattern"] = ARGUMENT_PATTERN
    spec_fields["deadline"]["description"] = (
        "Seconds since the epoch by which the job should finish; one already past at "
        "submission is refused (422, field `deadline`)"
    )
    spec_fields["priority"]["description"] = (
        "Orders the tenant's own jobs: in every policy but the elastic `ones`, the places "
        "the tenant's jobs hold in the policy's order go to its higher-priority jobs "
        "first; other tenants' jobs do not move"
    )
    for schema in ("JobDetail", "SubmittedJob"):
        _describe_detail(components[schema]["properties"])
    components["SubmittedJob"]["properties"]["warnings"]["description"] = (
        "Sentences the submitter should see at once, e.g. that no node registered today "
        "can hold the job (it is accepted and waits: nodes may join later)"
    )
    spec_body = {"schema": _ref("JobSpec")}
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "gpusched admission API",
            "version": version,
            "description": (
                "Submit, list, follow and cancel deep-learning training jobs. Every error "
                "is an RFC 9457 problem (application/problem+json)."
            ),
        },
        "components": {
            "schemas": components,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"bearer": []}],
        "paths": {
            "/v1/jobs": {
                "post": {
                    "summary": "Submit a job",
                    "operationId": "submitJob",
                    "parameters": [
                        {
                            "name": "Idempotency-Key",
                            "in": "header",
                            "required": False,
                            "schema": {
                                "type": "string",
                                "minLength": 1,
                                "maxLength": 255,
                                "pattern": params.IDEMPOTENCY_KEY_PATTERN,
                            },
                            "description": (
                                "A retry with the same key returns the same job: 1-255 "
                                "printable ASCII characters, no space at either end"
                            ),
                        }
                    ],
                    "requestBody": {
                        "required": True,
                        "content": {media: spec_body for media in ACCEPTED_TYPES},
                    },
                    "responses": {
                        "201": _json(
                            "Created, queued; `warnings` says at once when no node "
                            "registered today can hold the job",
                            _ref("SubmittedJob"),
                            headers=_LOCATION,
                            links=_JOB_LINKS,
                        ),
                        "200": _json(
                            "An Idempotency-Key replay: the job created before",
                            _ref("SubmittedJob"),
                            headers={
                                **_LOCATION,
                                "Idempotent-Replayed": {
                                    "schema": {"type": "string", "const": "true"}
                                },
                            },
                        ),
                        "400": _problem("Empty or malformed body, or a bad Idempotency-Key"),
                        "401": _UNAUTHORIZED,
                        "403": _problem("The job would exceed the tenant's GPU quota"),
                        "409": _problem("The Idempotency-Key names another tenant's job"),
                        "413": _problem("The body is larger than the limit"),
                        "415": _problem(
                            "Not JSON or YAML",
                            Accept_Post={"schema": {"type": "string"}},
                        ),
                        "422": _problem(
                            "A field is invalid, or the spec breaks a rule across fields "
                            "(iterations or epochs, batch sizes, parallelism) or gives a "
                            "deadline already past; `field` names it"
                        ),
                        "503": _UNAVAILABLE,
                    },
                },
                "get": {
                    "summary": "List the tenant's jobs, ordered by id",
                    "operationId": "listJobs",
                    "parameters": [
                        {
                            "name": "state",
                            "in": "query",
                            "description": (
                                "one state, or several separated by commas, in any case"
                            ),
                            "schema": {
                                "type": "string",
                                "pattern": params.STATE_PATTERN,
                                "examples": ["RUNNING", "queued,running"],
                            },
                        },
                        {
                            "name": "limit",
                            "in": "query",
                            "schema": {
                                "type": "integer",
                                "minimum": 1,
                                "maximum": params.MAX_PAGE,
                                "default": params.DEFAULT_PAGE,
                            },
                        },
                        {
                            "name": "after",
                            "in": "query",
                            "description": "the `next` of the previous page (a job id)",
                            "schema": _JOB_ID_SCHEMA,
                        },
                    ],
                    "responses": {
                        "200": _json("A page of jobs", _ref("JobList")),
                        "400": _problem("A bad query parameter; `field` names it"),
                        "401": _UNAUTHORIZED,
                    },
                },
            },
            "/v1/jobs/{id}": {
                "parameters": [_JOB_ID],
                "get": {
                    "summary": "One job: state, history, placement, progress, pending reason",
                    "operationId": "getJob",
                    "responses": {
                        "200": _json("The job record", _ref("JobDetail")),
                        "401": _UNAUTHORIZED,
                        "404": _NOT_FOUND,
                        "503": _UNAVAILABLE,
                    },
                },
                "delete": {
                    "summary": "Cancel a job (the scheduler stops it)",
                    "operationId": "cancelJob",
                    "responses": {
                        "202": _json("Cancel requested; the record as it was", _ref("JobDetail")),
                        "401": _UNAUTHORIZED,
                        "404": _NOT_FOUND,
                        "409": _problem("The job has already finished"),
                        "503": _UNAVAILABLE,
                    },
                },
            },
            "/v1/jobs/{id}/events": {
                "parameters": [_JOB_ID],
                "get": {
                    "summary": "Follow a job as server-sent events",
                    "description": (
                        "`event: job` with the current JobDetail first, then `event: state` "
                        "(JobStateEvent) per transition and `event: progress` "
                        "(JobProgressEvent) while it runs; the stream ends after a terminal "
                        "state."
                    ),
                    "operationId": "jobEvents",
                    "responses": {
                        "200": {
                            "description": (
                                "Server-sent events; the schema describes one event, its "
                                "`data` one JSON object"
                            ),
                            "content": {"text/event-stream": {"schema": _SERVER_SENT_EVENT}},
                        },
                        "401": _UNAUTHORIZED,
                        "404": _NOT_FOUND,
                        "503": _UNAVAILABLE,
                    },
                },
            },
            "/v1/cluster": {
                "get": {
                    "summary": "Nodes, GPUs, the jobs on each GPU, latest telemetry, totals",
                    "operationId": "cluster",
                    "responses": {
                        "200": _json("The cluster", _ref("ClusterView")),
                        "401": _UNAUTHORIZED,
                    },
                }
            },
            "/v1/history/export": {
                "get": {
                    "summary": "Finished jobs of a window as a native trace, and the cluster",
                    "description": (
                        "The jobs submitted in [`since`, `until`) that have finished "
                        "(SUCCEEDED, FAILED, CANCELLED) after running at least one "
                        "iteration, as native trace records ordered by submission, with "
                        "the iterations they really ran; beside them the shape of the "
                        "nodes registered now. A tenant's token exports its own jobs, an "
                        "operator's (GPUSCHED_OPERATORS) every tenant's"
                    ),
                    "operationId": "historyExport",
                    "parameters": [_time_parameter(name, when) for name, when in (
                        ("since", "submitted at or after this time (default: the first job)"),
                        ("until", "submitted before this time (default: now)"),
                    )],
                    "responses": {
                        "200": _json("The trace and the cluster", _ref("HistoryExport")),
                        "400": _problem("An unknown query parameter; `field` names it"),
                        "401": _UNAUTHORIZED,
                        "404": _problem(
                            "No finished job in the window (no-finished-jobs); the detail "
                            "counts the jobs left out"
                        ),
                        "422": _problem(
                            "`since` or `until` is not a time, or `since` is not before "
                            "`until`; `field` names it"
                        ),
                    },
                }
            },
            "/v1/predictor/size-error": {
                "get": {
                    "summary": "How far the predicted job sizes were from the truth",
                    "description": (
                        "Each finished job's iterations as the predictor predicted them "
                        "at its submission (the size forest, or the declared figure "
                        "without history), against those it ran: MAPE and the shares "
                        "within 10, 25 and 50 %, over every tenant's newest `window` "
                        "scored jobs"
                    ),
                    "operationId": "sizeError",
                    "responses": {
                        "200": _json("The error figures", _ref("SizeErrorReport")),
                        "401": _UNAUTHORIZED,
                        "503": _problem(
                            "No predictor answered",
                            Retry_After={"schema": {"type": "string", "const": "1"}},
                        ),
                    },
                }
            },
            "/healthz": {
                "get": {
                    "summary": "Health: 200 while the cluster can take and schedule jobs",
                    "operationId": "health",
                    "security": [],
                    "responses": {
                        "200": _json("Connected, the store takes writes, a scheduler leads",
                                     _ref("Health")),
                        "503": {
                            "description": (
                                "NATS is not reachable (a problem), or degraded: the store "
                                "takes no writes or no scheduler leads (a Health with its "
                                "problems)"
                            ),
                            "content": {
                                **_UNAVAILABLE["content"],
                                **_json("", _ref("Health"))["content"],
                            },
                            "headers": _UNAVAILABLE["headers"],
                        },
                    },
                }
            },
            "/metrics": {
                "get": {
                    "summary": "Prometheus metrics",
                    "operationId": "metrics",
                    "security": [],
                    "responses": {
                        "200": {
                            "description": "Prometheus text exposition format",
                            "content": {"text/plain": {"schema": {"type": "string"}}},
                        }
                    },
                }
            },
            "/openapi.json": {
                "get": {
                    "summary": "This document",
                    "operationId": "openapi",
                    "security": [],
                    "responses": {
                        "200": _json("OpenAPI 3.1", {"type": "object"}),
                    },
                }
            },
        },
        "x-job-states": [state.value for state in JobState],
    }


def _time_parameter(name: str, when: str) -> dict[str, Any]:
    return {
        "name": name,
        "in": "query",
        "description": (
            f"Jobs {when}: unix seconds, or an ISO 8601 date or time (no zone: UTC)"
        ),
        "schema": {
            "type": "string",
            "pattern": history.TIME_PATTERN,
            "examples": ["1767225600", "2026-01-01", "2026-01-01T09:30:00+01:00"],
        },
    }


def _describe_detail(detail: dict[str, Any]) -> None:
    detail["predicted_iterations"]["description"] = (
        "The iterations the predictor predicted at submission, written by the scheduler "
        "(null until it arrives); with `prediction_source` `forest` (the size forest "
        "learned the job's template) the scheduler's estimates use it, never above "
        "`total_iterations`; with `declared` it is the job's own figure"
    )
    detail["prediction_source"]["description"] = (
        "`forest` or `declared` (null: no prediction yet)"
    )
    detail["deadline_likely_met"]["description"] = (
        "null without a deadline or before the scheduler's first estimate; finished: "
        "whether it succeeded by its deadline; running: whether now + predicted remaining "
        "time is by it; waiting: whether now + predicted wait + run time is"
    )
