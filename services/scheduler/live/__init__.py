"""The live scheduler: the simulator's policies driven by NATS instead of a virtual clock.

One instance leads (it holds the KV lease); the others wait as hot standbys. The leader
keeps its picture of the cluster in one actor (``LiveScheduler``, around the
synchronous ``SchedulerCore``): job records from KV,
nodes from their registrations and heartbeats. Each round it builds a frozen snapshot,
asks the policy, and applies the decision by request/reply commands to node agents.
Durable inputs (submissions, cancels, exits) come from a JetStream pull consumer and are
acknowledged only once handled, so a crash of the leader loses none of them.

The package's modules, each importing only those above it in this list:

- ``timing``: how often and how soon the scheduler looks again (rescans, read-backs,
  redeliveries); the other modules read them there at each use, so a test changes one
  on ``live.timing`` (the copies this package re-exports are for reading);
- ``liveness``: when heartbeats arrived, noted ahead of the actor's queue;
- ``messages``: what the actor's inbox holds, and ``redeliver`` for a stored input it
  did not handle;
- the adapters, through which the actor makes every NATS and KV call: ``store``
  (``JobStore``: job records with revision checks, ``RecordConflict``,
  ``RecordUnsure``, the index of unfinished jobs, stored exits), ``registry``
  (``NodeRegistry``: node registrations), ``commands`` (``NodeCommands``: start, stop,
  resize and reallocate commands to node agents), ``predictor`` (``PredictorAsks``:
  estimates, remaining iterations, compute and GPU profiles) and ``publisher``
  (``Publisher``: job state events and decision summaries);
- ``reports``: what a node's report proves about its sender;
- ``effects``: what the core asks the world to do (a record to write, a command for
  a node, a question for the predictor, news, a round);
- the core, synchronous and free of NATS: ``picture`` (``Picture``: what the leader
  knows of jobs and nodes, and the steps that change a job's record), ``rounds``
  (``Rounds``: a round, and the application of its decision) and ``core``
  (``SchedulerCore``: its inputs), each class built on the one before;
- ``actor`` (``LiveScheduler``): the one task that owns the core, reads what an input
  needs read, hands it to the core and carries the core's effects out through the
  adapters;
- ``service``: ``SchedulerService``, the lease and leadership, the consumers and
  subscriptions that feed the actor, and its status.

Every name other code imports from ``gpusched.services.scheduler.live`` is imported
here, so importers need not know the modules.
"""

from __future__ import annotations

from gpusched.services.scheduler.live.actor import LiveScheduler
from gpusched.services.scheduler.live.commands import NodeCommand, NodeCommands
from gpusched.services.scheduler.live.commands import node_share as _node_share
from gpusched.services.scheduler.live.core import SchedulerCore
from gpusched.services.scheduler.live.liveness import Liveness
from gpusched.services.scheduler.live.messages import (
    Beat,
    ComputeMeasured,
    Durable,
    Estimated,
    Measured,
    Message,
    ProgressSeen,
    RemainingPredicted,
    Rescan,
    Resync,
    Round,
    StartResult,
    StopFailed,
    Sweep,
)
from gpusched.services.scheduler.live.picture import Picture
from gpusched.services.scheduler.live.predictor import PredictorAsks
from gpusched.services.scheduler.live.publisher import Publisher
from gpusched.services.scheduler.live.registry import NodeRegistry
from gpusched.services.scheduler.live.rounds import Rounds
from gpusched.services.scheduler.live.service import SCHEDULER_VERSION, SchedulerService
from gpusched.services.scheduler.live.store import JobStore, RecordConflict, RecordUnsure
from gpusched.services.scheduler.live.timing import (
    ORPHAN_INDEX_S,
    REDELIVER_MAX_S,
    REDELIVER_S,
    RESCAN_S,
    RESYNC_RETRY_S,
)

__all__ = [
    "ORPHAN_INDEX_S",
    "REDELIVER_MAX_S",
    "REDELIVER_S",
    "RESCAN_S",
    "RESYNC_RETRY_S",
    "SCHEDULER_VERSION",
    "Beat",
    "ComputeMeasured",
    "Durable",
    "Estimated",
    "JobStore",
    "LiveScheduler",
    "Liveness",
    "Measured",
    "Message",
    "NodeCommand",
    "NodeCommands",
    "NodeRegistry",
    "Picture",
    "PredictorAsks",
    "ProgressSeen",
    "Publisher",
    "RecordConflict",
    "RecordUnsure",
    "RemainingPredicted",
    "Rescan",
    "Resync",
    "Round",
    "Rounds",
    "SchedulerCore",
    "SchedulerService",
    "StartResult",
    "StopFailed",
    "Sweep",
    "_node_share",
]
