"""How often and how soon the live scheduler looks again: its rescans of the index of
unfinished jobs, read-backs of records and redeliveries of stored inputs.

The modules of the package read these as ``timing.NAME`` when they need them, so a
test that sets one on the package (``monkeypatch.setattr(live, "RESCAN_S", 1.0)``)
changes it here too (``live/__init__.py`` passes such a setting on).
"""

from __future__ import annotations

#: how often the leader looks for stored jobs it was never told about
RESCAN_S = 30.0
#: a live-index entry without a record after this long is one of a submit that failed
ORPHAN_INDEX_S = 120.0
#: a stored input whose handling failed comes back after this long, doubled per
#: delivery up to REDELIVER_MAX_S
REDELIVER_S = 0.5
REDELIVER_MAX_S = 10.0
#: how soon a record that could not be read back is asked for again
RESYNC_RETRY_S = 1.0
#: how many of the effects of different jobs (record writes, index entries) one step has
#: under way at once: enough to pipeline the writes of a round, few enough that they do
#: not queue ahead of the lease's renewal in the nats-server for seconds
EFFECTS_IN_FLIGHT = 64
