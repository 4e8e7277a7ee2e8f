"""fv-dynamo: fv engines as NVIDIA Dynamo workers (design §14: Dynamo orchestrates engines, never the engine core).

- :mod:`fv_dynamo.worker`: ``fv worker --config deploy.yaml`` (``python -m fv_dynamo.worker``).
- :mod:`fv_dynamo.card`: the DeploymentCard with the engine's cost model.
- :mod:`fv_dynamo.requests`: Dynamo's video/image payloads as fv Requests, refused as fv serve refuses them.
- :mod:`fv_dynamo.router`: the cost-aware router over Dynamo's direct routing.

Importing this package does not import Dynamo; the worker and the router do, when they run.
"""

__version__ = "0.1.0"
