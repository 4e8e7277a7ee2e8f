"""Serving product: ``fv serve``, an OpenAI-style video API over the Engine (FastAPI + uvicorn).

Needs the ``serve`` extra (in the fv checkout: ``pip install '.[serve]'``). Importing this package
imports FastAPI; the rest of the kernel never does.
"""

from fv_kernel.serving.app import create_app
from fv_kernel.serving.errors import ApiError
from fv_kernel.serving.jobs import JobManager
from fv_kernel.serving.server import ServerThread, serve_forever
from fv_kernel.serving.store import JobRecord, JobStore

__all__ = ["create_app", "ApiError", "JobManager", "JobRecord", "JobStore", "ServerThread", "serve_forever"]
