"""A node's command endpoint, as a NATS micro service.

Every agent adds a service ``gpusched-nodeagent`` (metadata: its node name) with one
endpoint, ``command``, on ``gpusched.node.<node>.command``: the subject the scheduler
sends to and the NATS permissions name. ``nats micro ls`` lists the agents, and
``$SRV.PING`` / ``$SRV.INFO`` / ``$SRV.STATS`` (also with the service name, and name and
id) answer as for the predictor.

Unlike the predictor's endpoints, this one answers every request with a
:class:`~gpusched.libs.common.schemas.CommandReply`, refusals and undecodable commands included
(``ok=False`` and the reason), never with ``Nats-Service-Error`` headers and an empty
body: the scheduler decodes the reply's body.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from typing import TypeVar, cast

import msgspec
from nats import micro
from nats.aio.client import Client
from nats.micro.service import Service

from gpusched.libs.common import codec, natsauth, subjects
from gpusched.libs.common.schemas import (
    SCHEMA_VERSION,
    Command,
    CommandReply,
    ComputeProfile,
    ComputeProfileRequest,
    CpuProfile,
    CpuProfileRequest,
    GpuProfileRequest,
    MeasuredProfile,
)

SERVICE_NAME = natsauth.NODEAGENT_SERVICE
SERVICE_VERSION = "0.1.0"
SERVICE_DESCRIPTION = "gpusched node agent: starts, stops and resizes jobs on one node"
ENDPOINT = "command"
PROFILE_ENDPOINT = "profile"
COMPUTE_PROFILE_ENDPOINT = "compute_profile"
GPU_PROFILE_ENDPOINT = "gpu_profile"
_COMMAND = cast("type[Command]", Command)
Wanted = TypeVar("Wanted", bound=msgspec.Struct)

def decode_command(data: bytes, headers: dict[str, str] | None) -> Command:
    """The command in a request. Raises ``msgspec.DecodeError`` naming the field, or the
    schema version when the request speaks another one."""
    schema = (headers or {}).get(codec.SCHEMA_HEADER)
    if schema is not None and schema != str(SCHEMA_VERSION):
        raise msgspec.DecodeError(
            f"schema version {schema} (header {codec.SCHEMA_HEADER}); this node "
            f"agent reads version {SCHEMA_VERSION}"
        )
    return codec.decode(data, _COMMAND)


async def serve_commands(
    nc: Client, node: str, answer: Callable[[Command], Awaitable[CommandReply]],
    answered: Callable[[str, CommandReply], None],
) -> Service:
    """Add the node's command service; ``answer`` replies to a decoded command, and
    ``answered`` is told the kind of each command and its reply (for metrics). The
    caller stops the service."""

    async def on_request(request: micro.Request) -> None:
        kind = "unknown"
        try:
            command = decode_command(request.data, request.headers)
        except msgspec.DecodeError as exc:
            reply = CommandReply(ok=False, error=f"undecodable command: {exc}")
        else:
            kind = str(command.__struct_config__.tag)
            reply = await answer(command)
        answered(kind, reply)
        # no reply subject, or a connection closing: the sender's timeout covers it
        with contextlib.suppress(Exception):
            await request.respond(codec.encode(reply), headers=codec.headers())

    service = await micro.add_service(
        nc,
        name=SERVICE_NAME,
        version=SERVICE_VERSION,
        description=SERVICE_DESCRIPTION,
        metadata={"node": node},
    )
    try:
        await service.add_endpoint(
            name=ENDPOINT, subject=subjects.node_command(node), handler=on_request,
            metadata={"node": node},
        )
    except BaseException:
        await service.stop()
        raise
    return service


async def serve_profiles(
    service: Service, node: str, measure: Callable[[str], Awaitable[CpuProfile]]
) -> None:
    """Add the ``profile`` endpoint on ``gpusched.node.<node>.profile``: a
    :class:`~gpusched.libs.common.schemas.CpuProfileRequest` in, the
    :class:`~gpusched.libs.common.schemas.CpuProfile` that ``measure`` takes of its model out.
    Errors use the ``Nats-Service-Error`` headers: 400 for an undecodable request, 500
    when measuring failed (the description says why)."""

    async def of_model(wanted: CpuProfileRequest) -> CpuProfile:
        return await measure(wanted.model)

    await _serve_measurement(
        service, node, PROFILE_ENDPOINT, subjects.node_profile(node), CpuProfileRequest, of_model
    )


async def serve_compute_profiles(
    service: Service, node: str,
    measure: Callable[[ComputeProfileRequest], Awaitable[ComputeProfile]],
) -> None:  # fmt: skip
    """Add the ``compute_profile`` endpoint on ``gpusched.node.<node>.compute_profile``:
    a :class:`~gpusched.libs.common.schemas.ComputeProfileRequest` in, the
    :class:`~gpusched.libs.common.schemas.ComputeProfile` ``measure`` takes out (GENIE's
    profiling run); errors as for ``profile``."""
    await _serve_measurement(
        service, node, COMPUTE_PROFILE_ENDPOINT, subjects.node_compute_profile(node),
        ComputeProfileRequest, measure,
    )  # fmt: skip


async def serve_gpu_profiles(
    service: Service, node: str,
    measure: Callable[[GpuProfileRequest], Awaitable[MeasuredProfile]],
) -> None:  # fmt: skip
    """Add the ``gpu_profile`` endpoint on ``gpusched.node.<node>.gpu_profile``: a
    :class:`~gpusched.libs.common.schemas.GpuProfileRequest` in, the figures ``measure``
    takes on the node's GPU type out (services/nodeagent/gpu_profiling.py); errors as for
    ``profile``."""
    await _serve_measurement(
        service, node, GPU_PROFILE_ENDPOINT, subjects.node_gpu_profile(node),
        GpuProfileRequest, measure,
    )  # fmt: skip


async def _serve_measurement(
    service: Service, node: str, name: str, subject: str, kind: type[Wanted],
    measure: Callable[[Wanted], Awaitable[msgspec.Struct]],
) -> None:  # fmt: skip
    async def on_request(request: micro.Request) -> None:
        try:
            wanted = codec.decode(request.data, kind)
        except msgspec.DecodeError as exc:
            await request.respond_error("400", f"undecodable {kind.__name__}: {exc}")
            return
        try:
            profile = await measure(wanted)
        except Exception as exc:
            await request.respond_error("500", " ".join(str(exc).split()) or repr(exc))
            return
        with contextlib.suppress(Exception):
            await request.respond(codec.encode(profile), headers=codec.headers())

    await service.add_endpoint(
        name=name, subject=subject, handler=on_request, metadata={"node": node}
    )
