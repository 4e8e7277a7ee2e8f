"""fv-comfyui: run ComfyUI workflows on fv (see README.md and docs/comfyui.md)."""

__version__ = "0.1.0"
