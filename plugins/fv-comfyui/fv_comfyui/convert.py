"""ComfyUI UI workflow (the graph the editor saves) → API prompt (what ``POST /prompt`` takes).

Reproduces what ComfyUI's frontend (``graphToPrompt``) sends, followed by the literal
conversion ComfyUI's ``validate_prompt`` writes back into the prompt it stores (an INT widget
through ``int()``, a FLOAT one through ``float()``: the ``16`` of a UI's fps is the API's
``16.0``). That stored prompt is what ComfyUI embeds in its outputs, and what the fixtures
pair with their workflows.

- ``widgets_values`` are positional over the node's widget inputs in ``INPUT_TYPES`` order;
  an input marked ``control_after_generate`` (a seed) is followed by one extra entry
  (``"randomize"``, ``"fixed"``...) that is not an input. A dict ``widgets_values`` is by name.
- Links become ``[source id as string, slot]``; a link into a widget-turned-input replaces
  that widget's value.
- Muted (mode 2) and bypassed (mode 4) nodes are left out. A link out of a bypassed node is
  passed through to the bypassed node's input of the same type (the input at the link's slot
  first, then the others in order), as the frontend does; when none matches, the input is
  left out. A link out of a muted node stays a link to a node the prompt lacks: ComfyUI's
  validation then answers it (``exception_during_inner_validation``).
- ``Note``/``MarkdownNote`` are dropped; a ``Reroute`` is followed to its source; a
  ``PrimitiveNode``'s value is written into the input it feeds.
- ``_meta.title`` is the node's title, else the class's display name.
- ``is_changed`` (``LoadImage``'s file hash) is not part of what the frontend sends; ComfyUI
  adds it when it runs the prompt. Given the input folder, the converter adds it too.

A node class fv does not cover keeps only its links (its widget names are unknown); the
prompt's validation then refuses it as ``missing_node_type``, as ComfyUI does.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Mapping

from fv_comfyui.nodes import NODE_SPECS, NodeSpec

__all__ = ["WorkflowFormatError", "ui_to_api", "is_ui_workflow", "image_is_changed", "CONTROL_VALUES"]

#: The extra ``widgets_values`` entry after a seed: what the editor does to it after a run.
CONTROL_VALUES = frozenset({"fixed", "increment", "decrement", "randomize"})
MUTED, BYPASSED = 2, 4
#: ``LoadImage``'s upload button is a widget the frontend serialises (``"upload": "image"``).
_UI_EXTRA_WIDGETS: Mapping[str, tuple[str, ...]] = {"LoadImage": ("upload",)}


class WorkflowFormatError(ValueError):
    """The document is not a UI workflow this converter can read; the message names the field."""


def is_ui_workflow(document: Any) -> bool:
    """A UI workflow has top-level ``nodes`` and ``links`` lists; an API prompt is an object of nodes."""
    return isinstance(document, dict) and isinstance(document.get("nodes"), list) and "links" in document


def _links(workflow: Mapping[str, Any]) -> dict[int, tuple[int, int, int, int, str]]:
    out: dict[int, tuple[int, int, int, int, str]] = {}
    for index, link in enumerate(workflow.get("links") or []):
        if isinstance(link, list) and len(link) >= 6:
            link_id, src, src_slot, dst, dst_slot, kind = link[:6]
        elif isinstance(link, dict):  # the newer serialisation
            link_id, src, src_slot = link.get("id"), link.get("origin_id"), link.get("origin_slot")
            dst, dst_slot, kind = link.get("target_id"), link.get("target_slot"), link.get("type")
        else:
            raise WorkflowFormatError(f"links[{index}]: expected [id, src, src_slot, dst, dst_slot, type], got {link!r}")
        out[int(link_id)] = (int(src), int(src_slot), int(dst), int(dst_slot), str(kind))
    return out


class _Graph:
    def __init__(self, workflow: Mapping[str, Any]) -> None:
        if workflow.get("definitions", {}).get("subgraphs") if isinstance(workflow.get("definitions"), dict) else False:
            raise WorkflowFormatError("definitions.subgraphs: workflows with subgraphs are not supported; unpack them first")
        self.nodes: dict[int, dict[str, Any]] = {}
        for index, node in enumerate(workflow["nodes"]):
            if not isinstance(node, dict) or "id" not in node or "type" not in node:
                raise WorkflowFormatError(f"nodes[{index}]: a node needs an 'id' and a 'type'")
            self.nodes[int(node["id"])] = node
        self.links = _links(workflow)

    def input_link(self, node: Mapping[str, Any], slot: int) -> int | None:
        inputs = node.get("inputs") or []
        return inputs[slot].get("link") if 0 <= slot < len(inputs) else None

    def resolve(self, link_id: int, wanted_type: str) -> tuple[str, Any] | None:
        """Follow a link through reroutes and bypassed nodes: ``("link", [id, slot])``, ``("value", v)`` or None."""
        seen: set[int] = set()
        while True:
            if link_id in seen:
                raise WorkflowFormatError(f"links: link {link_id} loops through reroutes or bypassed nodes")
            seen.add(link_id)
            if link_id not in self.links:
                raise WorkflowFormatError(f"links: an input names link {link_id}, which the workflow does not have")
            src, src_slot, _, _, _ = self.links[link_id]
            parent = self.nodes.get(src)
            if parent is None:
                return ("link", [str(src), src_slot])
            kind = parent["type"]
            if kind == "Reroute":
                nxt = self.input_link(parent, 0)
                if nxt is None:
                    return None
                link_id = nxt
                continue
            if kind == "PrimitiveNode":
                values = parent.get("widgets_values") or []
                return ("value", values[0]) if values else None
            if parent.get("mode") == BYPASSED:
                inputs = parent.get("inputs") or []
                candidates = [src_slot, *range(len(inputs))]
                chosen = next((i for i in candidates if 0 <= i < len(inputs) and inputs[i].get("type") == wanted_type), None)
                if chosen is None:
                    return None
                nxt = inputs[chosen].get("link")
                if nxt is None:
                    return None
                link_id = nxt
                continue
            return ("link", [str(src), src_slot])


def _widget_inputs(node: Mapping[str, Any], spec: NodeSpec | None) -> dict[str, Any]:
    values = node.get("widgets_values")
    if spec is None or values is None:
        return {}
    names = [w.name for w in spec.widgets] + list(_UI_EXTRA_WIDGETS.get(spec.class_type, ()))
    if isinstance(values, dict):
        return {name: values[name] for name in names if name in values}
    if not isinstance(values, list):
        raise WorkflowFormatError(f"node {node['id']}: widgets_values must be a list or an object")
    out: dict[str, Any] = {}
    position = 0
    controls = {w.name for w in spec.widgets if w.control_after_generate}
    for name in names:
        if position >= len(values):
            break  # fewer values than widgets: the missing input is validation's to report
        out[name] = values[position]
        position += 1
        if name in controls and position < len(values) and values[position] in CONTROL_VALUES:
            position += 1
    return out


def _coerce(inputs: dict[str, Any], spec: NodeSpec) -> None:
    """What ``validate_prompt`` writes back: INT/FLOAT literals through ``int()`` / ``float()``."""
    for item in spec.inputs:
        value = inputs.get(item.name)
        if value is None or isinstance(value, list) or isinstance(value, bool):
            continue
        try:
            if item.kind == "INT":
                inputs[item.name] = int(value)
            elif item.kind == "FLOAT":
                inputs[item.name] = float(value)
        except (TypeError, ValueError):
            pass  # left as is: validation answers invalid_input_type


def image_is_changed(path: Path) -> list[str]:
    """``LoadImage.IS_CHANGED``: the image file's SHA-256, as ComfyUI records it in the stored prompt."""
    return [hashlib.sha256(path.read_bytes()).hexdigest()]


def ui_to_api(
    workflow: Mapping[str, Any], specs: Mapping[str, NodeSpec] = NODE_SPECS, *, image_dir: Path | None = None
) -> dict[str, Any]:
    """The API prompt ComfyUI makes of ``workflow`` (see the module doc for the rules).

    With ``image_dir`` (ComfyUI's input folder), a ``LoadImage`` whose file is there also gets
    the ``is_changed`` entry ComfyUI adds when it runs the prompt (the file's SHA-256).
    """
    if not is_ui_workflow(workflow):
        raise WorkflowFormatError("workflow: expected a UI workflow with 'nodes' and 'links'")
    graph = _Graph(workflow)
    prompt: dict[str, Any] = {}
    for node_id in sorted(graph.nodes):
        node = graph.nodes[node_id]
        kind = node["type"]
        if kind in ("Note", "MarkdownNote", "Reroute", "PrimitiveNode") or node.get("mode") in (MUTED, BYPASSED):
            continue
        spec = specs.get(kind)
        inputs = _widget_inputs(node, spec)
        for slot in node.get("inputs") or []:
            link_id = slot.get("link")
            if link_id is None:
                continue
            resolved = graph.resolve(int(link_id), str(slot.get("type")))
            if resolved is None:
                continue
            inputs[slot["name"]] = resolved[1]
        if spec is not None:
            _coerce(inputs, spec)
        title = node.get("title") or (spec.display_name if spec is not None else kind)
        prompt[str(node_id)] = {"inputs": inputs, "class_type": kind, "_meta": {"title": title}}
        image = inputs.get("image")
        if kind == "LoadImage" and image_dir is not None and isinstance(image, str) and (image_dir / image).is_file():
            prompt[str(node_id)]["is_changed"] = image_is_changed(image_dir / image)
    return prompt
