"""ComfyUI's ``validate_prompt``, over the nodes fv covers, answering in ComfyUI's own shape.

Written from ComfyUI's ``execution.py`` (``validate_prompt`` / ``validate_inputs``) and
``server.py`` (``POST /prompt``), not copied. What it reproduces:

- whole-prompt errors: ``invalid_prompt`` (a node without ``class_type``, or a prompt that
  is not an object), ``missing_node_type`` (any node whose class fv does not cover, reached
  by an output or not), ``prompt_no_outputs``, ``prompt_outputs_failed_validation``;
- per-node errors, walking back from each output: ``required_input_missing``,
  ``bad_linked_input``, ``return_type_mismatch`` (and the walk does not enter that link),
  ``invalid_input_type`` (literals go through ``int()``/``float()``/``str()``/``bool()`` and
  are written back, so ``"2"`` passes for an INT), ``value_smaller_than_min`` /
  ``value_bigger_than_max`` (``step`` is not enforced), ``value_not_in_list``,
  ``custom_validation_failed`` (``LoadImage``: the file is not there),
  ``exception_during_inner_validation`` / ``exception_during_validation`` (a link to a
  missing node, an out-of-range slot, a node without ``inputs``), ``dependency_cycle``;
- ``node_errors[id] = {errors, dependent_outputs, class_type}``; a prompt with at least one
  valid output is accepted with ``node_errors`` for the failing ones, and only the valid
  outputs run.

Differences, on purpose: inputs are checked in ``INPUT_TYPES`` order (ComfyUI iterates a
set); an exception's ``traceback`` list in ``extra_info`` is empty (fv never shows a
traceback); a cycle is ``dependency_cycle`` on the node that closes it, where ComfyUI's
recursion would fail deeper.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from fv_comfyui.nodes import NODE_SPECS, InputSpec, NodeSpec

__all__ = ["ValidationContext", "ValidationResult", "validate_prompt"]


def _invalid_input_type(kind: str, name: str, info: Any, value: Any, exc: Exception) -> dict[str, Any]:
    """ComfyUI's error for an input value that does not convert to (or compare as) its type."""
    return {
        "type": "invalid_input_type",
        "message": f"Failed to convert an input value to a {kind} value",
        "details": f"{name}, {value}, {exc}",
        "extra_info": {"input_name": name, "input_config": info, "received_value": value, "exception_message": str(exc)},
    }


@dataclass(frozen=True)
class ValidationContext:
    """What the combo lists and custom checks read: model names per folder, and the input images."""

    folders: Mapping[str, Sequence[str]] = field(default_factory=dict)
    image_exists: Callable[[str], bool] = lambda name: False
    specs: Mapping[str, NodeSpec] = field(default_factory=lambda: NODE_SPECS)


@dataclass
class ValidationResult:
    """``(valid, error, good_outputs, node_errors)`` as ``validate_prompt`` returns it."""

    ok: bool
    error: dict[str, Any] | None
    good_outputs: list[str]
    node_errors: dict[str, Any]

    def response(self) -> tuple[int, dict[str, Any]]:
        """The HTTP status and body ``POST /prompt`` answers with when invalid (400)."""
        return 400, {"error": self.error, "node_errors": self.node_errors}


class _Cycle(Exception):
    pass


def _choices(spec: InputSpec, context: ValidationContext) -> list[str]:
    if spec.choices is not None:
        return list(spec.choices)
    return sorted(context.folders.get(spec.folder or "", ()))


def _input_config(spec: InputSpec, context: ValidationContext) -> list[Any]:
    kind: Any = _choices(spec, context) if spec.kind == "COMBO" else spec.kind
    return [kind, spec.options()]


def _convert(kind: str, value: Any) -> Any:
    if kind == "INT":
        return int(value)
    if kind == "FLOAT":
        return float(value)
    if kind == "STRING":
        return str(value)
    if kind == "BOOLEAN":
        return bool(value)
    return value


class _Validator:
    def __init__(self, prompt: dict[str, Any], context: ValidationContext) -> None:
        self.prompt = prompt
        self.context = context
        self.validated: dict[str, tuple[bool, list[dict[str, Any]], str]] = {}
        self.stack: list[str] = []

    def inputs(self, unique_id: str) -> tuple[bool, list[dict[str, Any]], str]:
        if unique_id in self.validated:
            return self.validated[unique_id]
        if unique_id in self.stack:
            raise _Cycle(unique_id)
        self.stack.append(unique_id)
        try:
            return self._inputs(unique_id)
        finally:
            self.stack.pop()

    def _inputs(self, unique_id: str) -> tuple[bool, list[dict[str, Any]], str]:
        node = self.prompt[unique_id]
        inputs = node["inputs"]  # KeyError when missing, as in ComfyUI
        spec = self.context.specs[node["class_type"]]
        errors: list[dict[str, Any]] = []
        valid = True
        for item in spec.inputs:
            name = item.name
            info = _input_config(item, self.context)
            if name not in inputs:
                if not item.optional:
                    errors.append({
                        "type": "required_input_missing", "message": "Required input is missing",
                        "details": name, "extra_info": {"input_name": name},
                    })
                continue
            val = inputs[name]
            if isinstance(val, list):
                if len(val) != 2:
                    errors.append({
                        "type": "bad_linked_input",
                        "message": "Bad linked input, must be a length-2 list of [node_id, slot_index]",
                        "details": name, "extra_info": {"input_name": name, "input_config": info, "received_value": val},
                    })
                    continue
                o_id = val[0]
                # A missing node or slot raises here, uncaught, as in ComfyUI: the caller that
                # walked into this node records it (exception_during_inner_validation on this
                # node, or exception_during_validation when this node is the output).
                received_type = self.context.specs[self.prompt[o_id]["class_type"]].return_types[val[1]]
                if received_type != item.kind and item.kind != "*":
                    errors.append({
                        "type": "return_type_mismatch", "message": "Return type mismatch between linked nodes",
                        "details": f"{name}, received_type({received_type}) mismatch input_type({item.kind})",
                        "extra_info": {"input_name": name, "input_config": info, "received_type": received_type,
                                       "linked_node": val},
                    })
                    continue
                try:
                    if self.inputs(o_id)[0] is False:
                        valid = False  # the linked node recorded its own errors
                        continue
                except _Cycle:
                    valid = False
                    errors.append({
                        "type": "dependency_cycle", "message": "Dependency cycle detected",
                        "details": f"{name}: node {o_id} depends on this node",
                        "extra_info": {"input_name": name, "linked_node": val},
                    })
                    continue
                except Exception as ex:  # noqa: BLE001
                    valid = False
                    self._inner_exception(o_id, name, info, val, ex)
                    continue
            else:
                if isinstance(val, dict) and "__value__" in val:
                    val = val["__value__"]
                    inputs[name] = val
                try:
                    val = _convert(item.kind, val)
                    if item.kind in ("INT", "FLOAT", "STRING", "BOOLEAN"):
                        inputs[name] = val
                except Exception as ex:  # noqa: BLE001 - int()/float() raise ValueError or TypeError
                    errors.append(_invalid_input_type(item.kind, name, info, val, ex))
                    continue
                custom = spec.validate is not None and name == "image"
                if custom:
                    continue  # VALIDATE_INPUTS takes this input: no range or list check (as ComfyUI)
                try:
                    if item.min is not None and val < item.min:
                        errors.append({
                            "type": "value_smaller_than_min", "message": f"Value {val} smaller than min of {item.min}",
                            "details": name, "extra_info": {"input_name": name, "input_config": info, "received_value": val},
                        })
                        continue
                    if item.max is not None and val > item.max:
                        errors.append({
                            "type": "value_bigger_than_max", "message": f"Value {val} bigger than max of {item.max}",
                            "details": name, "extra_info": {"input_name": name, "input_config": info, "received_value": val},
                        })
                        continue
                except TypeError as ex:  # a combo's value compared with a number cannot happen; a list value can
                    errors.append(_invalid_input_type(item.kind, name, info, val, ex))
                    continue
                if item.kind == "COMBO":
                    choices = _choices(item, self.context)
                    if val not in choices:
                        config: Any = info
                        if len(choices) > 20:
                            listed = f"(list of length {len(choices)})"
                            config = None
                        else:
                            listed = str(choices)
                        errors.append({
                            "type": "value_not_in_list", "message": "Value not in list",
                            "details": f"{name}: '{val}' not in {listed}",
                            "extra_info": {"input_name": name, "input_config": config, "received_value": val},
                        })
                        continue
        if spec.validate is not None and not errors:
            problem = spec.validate(inputs, self.context)
            if problem is not None:
                errors.append({
                    "type": "custom_validation_failed", "message": "Custom validation failed for node",
                    "details": f"image - {problem}", "extra_info": {"input_name": "image"},
                })
        ret = (False, errors, unique_id) if errors or valid is not True else (True, [], unique_id)
        self.validated[unique_id] = ret
        return ret

    def _inner_exception(self, o_id: Any, name: str, info: Any, val: Any, ex: Exception) -> None:
        self.validated[o_id] = (False, [{
            "type": "exception_during_inner_validation", "message": "Exception when validating inner node",
            "details": str(ex),
            "extra_info": {"input_name": name, "input_config": info, "exception_message": str(ex),
                           "exception_type": type(ex).__qualname__, "traceback": [], "linked_node": val},
        }], o_id)


def validate_prompt(prompt: Any, context: ValidationContext, partial_execution_targets: Sequence[str] | None = None) -> ValidationResult:
    """ComfyUI's answer to ``prompt``; ``inputs`` literals are converted in place, as ComfyUI does."""
    if not isinstance(prompt, dict):
        return ValidationResult(False, {
            "type": "invalid_prompt", "message": "Cannot execute because the prompt is not an object of nodes.",
            "details": type(prompt).__name__, "extra_info": {},
        }, [], {})
    outputs: list[str] = []
    for x, node in prompt.items():
        if not isinstance(node, dict) or "class_type" not in node:
            return ValidationResult(False, {
                "type": "invalid_prompt", "message": "Cannot execute because a node is missing the class_type property.",
                "details": f"Node ID '#{x}'", "extra_info": {},
            }, [], {})
        class_type = node["class_type"]
        spec = context.specs.get(class_type) if isinstance(class_type, str) else None
        if spec is None:
            meta = node.get("_meta")
            title = meta.get("title", class_type) if isinstance(meta, dict) else class_type
            return ValidationResult(False, {
                "type": "missing_node_type",
                "message": f"Node '{title}' not found. The custom node may not be installed.",
                "details": f"Node ID '#{x}'",
                "extra_info": {"node_id": x, "class_type": class_type, "node_title": title},
            }, [], {})
        if spec.output_node and (partial_execution_targets is None or x in partial_execution_targets):
            outputs.append(x)
    if not outputs:
        return ValidationResult(False, {
            "type": "prompt_no_outputs", "message": "Prompt has no outputs", "details": "", "extra_info": {},
        }, [], {})
    validator = _Validator(prompt, context)
    good: list[str] = []
    failed: list[tuple[str, list[dict[str, Any]]]] = []
    node_errors: dict[str, Any] = {}
    for o in outputs:
        try:
            valid, reasons, _ = validator.inputs(o)
        except Exception as ex:  # noqa: BLE001 - the output node itself could not be read
            valid = False
            reasons = [{
                "type": "exception_during_validation", "message": "Exception when validating node",
                "details": str(ex), "extra_info": {"exception_type": type(ex).__qualname__, "traceback": []},
            }]
            validator.validated[o] = (False, reasons, o)
        if valid is True:
            good.append(o)
            continue
        failed.append((o, reasons))
        for node_id, (node_valid, node_reasons, _) in validator.validated.items():
            # downstream nodes of a failing node are invalid without reasons: not reported
            if node_valid is not True and node_reasons:
                if node_id not in node_errors:
                    node_errors[node_id] = {
                        "errors": node_reasons, "dependent_outputs": [], "class_type": prompt[node_id]["class_type"],
                    }
                node_errors[node_id]["dependent_outputs"].append(o)
    if not good:
        details = "\n".join(f"{e['message']}: {e['details']}" for _, reasons in failed for e in reasons)
        return ValidationResult(False, {
            "type": "prompt_outputs_failed_validation", "message": "Prompt outputs failed validation",
            "details": details, "extra_info": {},
        }, [], node_errors)
    return ValidationResult(True, None, good, node_errors)
