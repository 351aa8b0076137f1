"""The states a model peer's sharding, its export of a group's share units and a peer's
deployment of a plan go through, defined once. They are `StrEnum`s: on the wire
(ManifestOffer, SharesOffer, DeployReport) and in the status document they are their plain
string values."""

from __future__ import annotations

import enum


class ModelState(enum.StrEnum):
    SHARDING = "sharding"
    READY = "ready"
    FAILED = "failed"
    UNKNOWN = "unknown"  # a peer that only heard of the model (status only, never sent)


class ExportState(enum.StrEnum):
    """A group stage's share units on the model peer (SharesOffer)."""

    EXPORTING = "exporting"
    READY = "ready"
    FAILED = "failed"


class DeployState(enum.StrEnum):
    IDLE = "idle"  # no plan yet
    PENDING = "pending"  # a plan accepted, work not started
    FETCHING = "fetching"
    LOADING = "loading"
    READY = "ready"
    FAILED = "failed"


# What a ManifestOffer and a DeployReport may carry.
OFFERED_MODEL_STATES = frozenset({ModelState.SHARDING, ModelState.READY, ModelState.FAILED})
REPORTED_DEPLOY_STATES = frozenset(
    {DeployState.FETCHING, DeployState.LOADING, DeployState.READY, DeployState.FAILED}
)
