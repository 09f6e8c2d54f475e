"""The OpenAPI 3.1 description of the HTTP API, generated from the msgspec types."""

from __future__ import annotations

from typing import Any

import msgspec

from libs.common.schemas import JobProgressEvent, JobRecord, JobSpec, JobState, JobStateEvent
from services.admission.problems import PROBLEM_CONTENT_TYPE, Problem
from services.admission.specs import ACCEPTED_TYPES
from services.admission.views import ClusterView, Health, JobList

_REF = "#/components/schemas/{name}"


def _ref(name: str) -> dict[str, str]:
    return {"$ref": _REF.format(name=name)}


def _problem(description: str) -> dict[str, Any]:
    return {
        "description": description,
        "content": {PROBLEM_CONTENT_TYPE: {"schema": _ref("Problem")}},
    }


def _json(description: str, schema: dict[str, Any], **extra: Any) -> dict[str, Any]:
    content = {"application/json": {"schema": schema}}
    return {"description": description, "content": content, **extra}


_JOB_ID = {
    "name": "id",
    "in": "path",
    "required": True,
    "schema": {"type": "string", "pattern": r"^[A-Za-z0-9_-]{1,64}$"},
}
_UNAUTHORIZED = _problem("Missing or unknown bearer token")
_NOT_FOUND = _problem("No such job for this tenant")
_UNAVAILABLE = _problem("NATS is not reachable; nothing was written")
_LOCATION = {"Location": {"schema": {"type": "string"}, "description": "/v1/jobs/<id>"}}


def build_openapi(version: str = "0.1.0") -> dict[str, Any]:
    _, components = msgspec.json.schema_components(
        [JobSpec, JobRecord, JobList, ClusterView, Problem, Health, JobStateEvent,
         JobProgressEvent],
        ref_template=_REF,
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
                            "schema": {"type": "string", "maxLength": 255},
                            "description": "A retry with the same key returns the same job",
                        }
                    ],
                    "requestBody": {
                        "required": True,
                        "content": {media: spec_body for media in ACCEPTED_TYPES},
                    },
                    "responses": {
                        "201": _json("Created, queued", _ref("JobRecord"), headers=_LOCATION),
                        "200": _json(
                            "An Idempotency-Key replay: the job created before",
                            _ref("JobRecord"),
                            headers={
                                **_LOCATION,
                                "Idempotent-Replayed": {"schema": {"type": "string"}},
                            },
                        ),
                        "400": _problem("Empty or malformed body, or a bad Idempotency-Key"),
                        "401": _UNAUTHORIZED,
                        "403": _problem("The job would exceed the tenant's GPU quota"),
                        "413": _problem("The body is larger than the limit"),
                        "415": _problem("Not JSON or YAML"),
                        "422": _problem("A field is invalid; `field` names it"),
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
                            "description": "one state, or several separated by commas",
                            "schema": {"type": "string", "examples": ["RUNNING", "QUEUED,RUNNING"]},
                        },
                        {
                            "name": "limit",
                            "in": "query",
                            "schema": {"type": "integer", "minimum": 1, "maximum": 1000,
                                       "default": 50},
                        },
                        {
                            "name": "after",
                            "in": "query",
                            "description": "the `next` of the previous page",
                            "schema": {"type": "string"},
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
                        "200": _json("The job record", _ref("JobRecord")),
                        "401": _UNAUTHORIZED,
                        "404": _NOT_FOUND,
                        "503": _UNAVAILABLE,
                    },
                },
                "delete": {
                    "summary": "Cancel a job (the scheduler stops it)",
                    "operationId": "cancelJob",
                    "responses": {
                        "202": _json("Cancel requested; the record as it was", _ref("JobRecord")),
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
                        "`event: job` with the current JobRecord first, then `event: state` "
                        "(JobStateEvent) per transition and `event: progress` "
                        "(JobProgressEvent) while it runs; the stream ends after a terminal "
                        "state."
                    ),
                    "operationId": "jobEvents",
                    "responses": {
                        "200": {
                            "description": "text/event-stream, each `data:` one JSON object",
                            "content": {"text/event-stream": {"schema": {"type": "string"}}},
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
            "/healthz": {
                "get": {
                    "summary": "Liveness: 200 while connected to NATS",
                    "operationId": "health",
                    "security": [],
                    "responses": {
                        "200": _json("Connected", _ref("Health")),
                        "503": _UNAVAILABLE,
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
