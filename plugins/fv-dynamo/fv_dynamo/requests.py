"""Dynamo's video and image requests as fv Requests, refused exactly as ``fv serve`` refuses them.

Dynamo's frontend parses the OpenAI fields (``prompt``, ``model``, ``size``, ``seconds``,
``nvext``) and nests every other top-level field under ``extra_args.media_passthrough``.
fv's own fields (``steps``, ``guidance``, ``seed``, ``negative_prompt``, ``frames``, ``fps``,
``extensions``) arrive there, and ``nvext``'s equivalents are accepted too. The merged body
goes through fv serve's own schemas (:class:`~fv_kernel.api.VideoCreate`,
:class:`~fv_kernel.api.ImageGenerate`) and error mapping, so a bad field gets the same
``{"error": {"message", "type", "param", "code"}}`` body fv serve answers with.
"""

from __future__ import annotations

import secrets
import uuid
from typing import Any, Mapping

from pydantic import ValidationError

from fv_kernel.api import (
    DiffusionParams,
    Engine,
    FvError,
    ModelInstance,
    OutputSpec,
    Request,
    TaskType,
    TextPart,
    frames_for_seconds,
)
import fv_kernel.api as api

__all__ = ["FleetRequestError", "video_request", "image_requests", "NVEXT_FIELDS"]

#: nvext's names for fields fv takes under its own names.
NVEXT_FIELDS = {
    "num_inference_steps": "steps",
    "guidance_scale": "guidance",
    "seed": "seed",
    "negative_prompt": "negative_prompt",
    "fps": "fps",
    "num_frames": "frames",
}


class FleetRequestError(Exception):
    """A refusal with fv serve's HTTP status and body."""

    def __init__(self, status: int, body: dict[str, Any]) -> None:
        super().__init__(body["error"]["message"])
        self.status = status
        self.body = body

    @classmethod
    def from_api_error(cls, error: Any) -> "FleetRequestError":
        return cls(error.status, error.body())


def _refuse(status: int, error_type: str, message: str, param: str | None) -> FleetRequestError:
    return FleetRequestError(status, api.error_body(error_type, message, param))


#: Top-level fields of Dynamo's parsed requests (NvCreateVideoRequest / NvCreateImageRequest) that
#: fv reads or checks; anything else at the top level is refused, as fv serve refuses unknown fields.
_DYNAMO_FIELDS = frozenset({
    "model", "prompt", "size", "seconds", "n", "input_reference", "user", "response_format", "output_format", "stream",
    "nvext", "extra_args", "quality", "style", "moderation",
})


def _merged_body(payload: Mapping[str, Any], openai_fields: tuple[str, ...]) -> dict[str, Any]:
    """The request's fields as fv names them: OpenAI fields, then nvext's, then the passthrough (fv's own)."""
    for name in payload:
        if name not in _DYNAMO_FIELDS:
            raise _refuse(400, "unknown_field", f"{name}: unknown field (fv's own fields travel in "
                          "extra_args.media_passthrough, where Dynamo's frontend puts them)", name)
    body = {k: payload[k] for k in openai_fields if payload.get(k) is not None}
    nvext = payload.get("nvext") or {}
    for name, value in nvext.items():
        if value is None or name == "annotations":
            continue
        if name not in NVEXT_FIELDS:
            raise _refuse(400, "unknown_field", f"nvext.{name}: not supported by fv; allowed: {', '.join(NVEXT_FIELDS)}",
                          f"nvext.{name}")
        body[NVEXT_FIELDS[name]] = value
    passthrough = (payload.get("extra_args") or {}).get("media_passthrough") or {}
    for name, value in passthrough.items():
        fv_name = NVEXT_FIELDS.get(name, name)
        if fv_name in body and body[fv_name] != value:
            raise _refuse(400, "invalid_request", f"{name}: given twice with different values", name)
        body[fv_name] = value
    return body


def _instance(engine: Engine, model: str | None) -> ModelInstance:
    instances = engine.instances
    if model is None and len(instances) == 1:
        return next(iter(instances.values()))
    instance = instances.get(model or "")
    if instance is None:
        allowed = ", ".join(sorted(instances)) or "none"
        raise _refuse(404, "unknown_model", f"model: unknown card {model!r}; allowed: {allowed}", "model")
    return instance


def _plugin_params(engine: Engine, extensions: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per-request plugin parameters: only extensions the deployment enabled, through their schema."""
    enabled = engine.extensions.interceptors
    params: dict[str, dict[str, Any]] = {}
    for name, values in extensions.items():
        where = f"extensions.{name}"
        interceptor = enabled.get(name)
        if interceptor is None:
            allowed = ", ".join(sorted(enabled)) or "none (the deployment enables no extensions)"
            raise _refuse(400, "extension_not_enabled",
                          f"{where}: this deployment does not enable {name!r}; allowed: {allowed}", where)
        schema = getattr(interceptor, "request_model", None)
        if schema is None:
            if values:
                raise _refuse(400, "unknown_field", f"{where}: {name!r} takes no per-request parameters", where)
            params[name] = {}
            continue
        try:
            params[name] = schema.model_validate(dict(values)).model_dump(mode="json")
        except ValidationError as exc:
            raise FleetRequestError.from_api_error(api.from_validation_errors(exc.errors(), prefix=where)) from None
    return params


def _build(engine: Engine, body: Any, instance: ModelInstance, *, request_id: str, task: TaskType,
           frames: int | None, fps: float | None, seed: int, stream_previews: bool) -> Request:
    width = height = None
    if body.size is not None:
        try:
            width, height = api.parse_size(body.size)
        except ValueError as exc:
            raise _refuse(400, "invalid_request", f"size: {exc}", "size") from None
    inputs: list[Any] = [TextPart(text=body.prompt)]
    if body.negative_prompt:
        inputs.append(TextPart(text=body.negative_prompt, role="negative_prompt"))
    try:
        request = Request(
            request_id=request_id, model=instance.model_id, task=task, inputs=tuple(inputs),
            diffusion=DiffusionParams(width=width, height=height, frames=frames, fps=fps, steps=body.steps,
                                      guidance=body.guidance, seed=seed),
            plugin_params=_plugin_params(engine, body.extensions),
            output=OutputSpec(stream_previews=stream_previews), allow_outside_envelope=body.allow_outside_envelope,
        )
    except ValidationError as exc:
        raise FleetRequestError.from_api_error(api.from_validation_errors(exc.errors())) from None
    try:
        return engine.validate(request)
    except FvError as exc:
        raise FleetRequestError.from_api_error(api.from_fv_error(exc)) from None


def video_request(engine: Engine, payload: Mapping[str, Any]) -> Request:
    """A Dynamo ``/v1/videos`` payload as a validated fv Request (defaults filled), or :class:`FleetRequestError`."""
    body_fields = _merged_body(payload, ("model", "prompt", "size", "seconds"))
    if payload.get("input_reference") is not None:
        # fv serve decodes it into an ImagePart; through Dynamo this worker does not take images yet.
        raise _refuse(400, "invalid_request",
                      "input_reference: image-to-video is not served through fv's Dynamo worker yet; use fv serve",
                      "input_reference")
    if payload.get("response_format") not in (None, "b64_json"):
        raise _refuse(400, "invalid_request",
                      f"response_format: {payload['response_format']!r} is not served (no media store); allowed: b64_json",
                      "response_format")
    if payload.get("output_format") not in (None, "mp4"):
        raise _refuse(400, "invalid_request", f"output_format: {payload['output_format']!r}; allowed: mp4", "output_format")
    try:
        body = api.VideoCreate.model_validate(body_fields)
    except ValidationError as exc:
        raise FleetRequestError.from_api_error(api.from_validation_errors(exc.errors())) from None
    if body.seconds is not None and body.frames is not None:
        raise _refuse(400, "invalid_request", "seconds: give seconds or frames, not both", "seconds")
    instance = _instance(engine, body.model)
    frames, fps = body.frames, body.fps
    if body.seconds is not None:
        try:
            frames, fps = frames_for_seconds(  # fv serve's rule
                instance.card, body.seconds, body.fps, allow_outside_envelope=body.allow_outside_envelope
            )
        except FvError as exc:
            raise FleetRequestError.from_api_error(api.from_fv_error(exc)) from None
    seed = body.seed if body.seed is not None else secrets.randbelow(2**31)
    return _build(engine, body, instance, request_id=f"video_{uuid.uuid4().hex}", task=TaskType.TEXT_TO_VIDEO,
                  frames=frames, fps=fps, seed=seed, stream_previews=False)


def image_requests(engine: Engine, payload: Mapping[str, Any]) -> list[Request]:
    """A Dynamo ``/v1/images/generations`` payload as ``n`` validated fv Requests (seeds ``seed .. seed+n-1``)."""
    body_fields = _merged_body(payload, ("model", "prompt", "size", "n", "response_format"))
    for unsupported in ("input_reference", "quality", "style", "moderation"):
        if payload.get(unsupported) is not None:
            raise _refuse(400, "unknown_field", f"{unsupported}: not supported by fv", unsupported)
    try:
        body = api.ImageGenerate.model_validate(body_fields)
    except ValidationError as exc:
        raise FleetRequestError.from_api_error(api.from_validation_errors(exc.errors())) from None
    instance = _instance(engine, body.model)
    seed = body.seed if body.seed is not None else secrets.randbelow(2**31)
    return [
        _build(engine, body, instance, request_id=f"image_{uuid.uuid4().hex}", task=TaskType.TEXT_TO_IMAGE,
               frames=None, fps=None, seed=seed + i, stream_previews=False)
        for i in range(body.n)
    ]
