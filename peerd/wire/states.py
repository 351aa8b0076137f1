"""The states a model peer's sharding and a peer's deployment of a plan go through, defined
once. They are `StrEnum`s: on the wire (ManifestOffer, DeployReport) and in the status
document they are their plain string values."""

from __future__ import annotations

import enum


class ModelState(enum.StrEnum):
    SHARDING = "sharding"
    READY = "ready"
    FAILED = "failed"
    UNKNOWN = "unknown"  # a peer that only heard of the model (status only, never sent)


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
