"""Wan model definitions: transformer (DiT), text/image encoders, tokenizer, VAEs.

Import the submodules directly (``fv_wan.models.transformer`` ...); this package
does not import them eagerly so that loading one does not pull in the others.
"""
