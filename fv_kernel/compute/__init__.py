"""Compute drivers (attention backends, …), selected by name from ``fv.<kind>`` entry points.

Nothing is imported eagerly: a deployment imports only the driver it selects, via
``host.drivers("attention_backends").load(name)``.
"""
