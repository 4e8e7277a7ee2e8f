"""The toy world: a procedural video world small enough to train a card on, and its judge.

- :mod:`fv_wan.toy.grammar`: the prompt grammar (colours, shapes, directions, speeds,
  backgrounds; one or two objects), parsing, sampling and the train / held-out split.
- :mod:`fv_wan.toy.world`: a vectorised torch renderer of a scene into a clip, and
  :class:`~fv_wan.toy.world.ToyWorld`, a deterministic stream of training batches.
- :mod:`fv_wan.toy.judge`: an analyser that checks a video against its prompt (colour,
  direction, shape, speed per object; temporal stability per clip).

Documented in ``docs/models/toy-world.md``. Submodules are imported on use (the
grammar needs no torch at import time beyond its sampler's type).
"""
