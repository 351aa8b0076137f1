"""Why the planner refuses: bad input, or a cluster that cannot hold the model."""


class PlannerError(ValueError):
    """Base class: the message is one line meant for the user."""


class InvalidInput(PlannerError):
    """The cluster, units or plan are inconsistent (unknown ids, negative numbers, ...)."""


class Infeasible(PlannerError):
    """No plan satisfies the constraints; the message names the shortfall."""
