"""``/openapi.json`` as the API behaves: request bodies from the pydantic models that validate them,
the error statuses each route really returns, and no FastAPI default that never occurs.

The two POST routes read their bodies themselves (the JSON is bounded before it is parsed,
see :mod:`fv_kernel.serving.limits`), so FastAPI cannot infer their request bodies; each
declares it with ``openapi_extra`` (:func:`request_body`) and :func:`install_openapi` adds
the referenced models' JSON schemas to the document's components. FastAPI's automatic
``422`` is removed everywhere: a validation failure is answered ``400`` (see
:mod:`fv_kernel.serving.errors`).
"""

from __future__ import annotations

import copy
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from fv_kernel.serving.schemas import JOB_ID_PATTERN, ErrorResponse, ImageGenerate, VideoCreate

__all__ = ["error_responses", "request_body", "install_openapi", "ERROR_DESCRIPTIONS"]

_REF = "#/components/schemas/{model}"

#: What each error status means in this API (the ``description`` of its OpenAPI response).
ERROR_DESCRIPTIONS: dict[int, str] = {
    400: "Invalid request: malformed or too deeply nested JSON, an unknown field, or a value the card or deployment refuses",
    401: "Missing or invalid API key",
    404: "Unknown video id or model",
    409: "The job is in a state that does not allow this",
    413: "The body exceeds server.max_body_bytes, or the input image declares more than server.max_image_pixels",
    415: "Unsupported content type",
    429: "The queue is full (see Retry-After)",
    499: "The client disconnected; its images were cancelled",
    500: "The generation failed on the server",
    503: "The server stopped before the images were generated",
}


def error_responses(*statuses: int, auth: bool) -> dict[int | str, dict[str, Any]]:
    """OpenAPI responses for the error ``statuses`` a route returns (plus 401 when an API key is required)."""
    codes = sorted(set(statuses) | ({401} if auth else set()))
    return {code: {"model": ErrorResponse, "description": ERROR_DESCRIPTIONS[code]} for code in codes}


def _form_schema(model: type[BaseModel], *, file_field: str | None) -> dict[str, Any]:
    """The model's fields as form fields: text values (``extensions`` as JSON text), one optional file part."""
    schema = copy.deepcopy(model.model_json_schema(ref_template=_REF))
    for name, prop in schema["properties"].items():
        options = prop.pop("anyOf", None)
        if options is not None:  # a form field is absent, never null
            prop.update(next(o for o in options if o.get("type") != "null"))
        prop.pop("default", None)
        if name == "extensions":
            prop.clear()
            prop.update(type="string", description="the extensions object as JSON text, e.g. {\"my-cache\": {}}; empty: none")
        elif name == file_field:
            prop.clear()
            prop.update(type="string", format="binary", description="the first frame for image-to-video, as an image file")
    schema["title"] = f"{model.__name__}Form"
    return schema


def request_body(model: type[BaseModel], *, form: bool) -> dict[str, Any]:
    """``openapi_extra`` declaring a route's request body as ``model`` (JSON; also form fields when ``form``)."""
    content: dict[str, Any] = {"application/json": {"schema": {"$ref": _REF.format(model=model.__name__)}}}
    if form:
        content["multipart/form-data"] = {"schema": {"$ref": _REF.format(model=f"{model.__name__}Multipart")}}
        content["application/x-www-form-urlencoded"] = {"schema": {"$ref": _REF.format(model=f"{model.__name__}Form")}}
    return {"requestBody": {"required": True, "content": content}}


def install_openapi(app: FastAPI) -> None:
    """Replace ``app.openapi`` with the generator of this API's document (built once, then cached)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        document = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        schemas = document.setdefault("components", {}).setdefault("schemas", {})
        for model in (VideoCreate, ImageGenerate):
            schemas[model.__name__] = model.model_json_schema(ref_template=_REF)
        schemas["VideoCreateMultipart"] = _form_schema(VideoCreate, file_field="input_reference")
        schemas["VideoCreateMultipart"]["title"] = "VideoCreateMultipart"
        schemas["VideoCreateForm"] = _form_schema(VideoCreate, file_field=None)
        for item in document["paths"].values():
            for operation in item.values():
                operation.get("responses", {}).pop("422", None)
                for parameter in operation.get("parameters", ()):
                    if parameter["in"] == "path" and parameter["name"] == "video_id":
                        parameter["schema"]["pattern"] = JOB_ID_PATTERN.pattern
        for unused in ("HTTPValidationError", "ValidationError"):
            schemas.pop(unused, None)
        app.openapi_schema = document
        return document

    app.openapi = openapi  # type: ignore[method-assign]
