"""fv-rl: training methods (the ``rl_methods`` contribution kind) that ``fv train`` runs."""

__version__ = "0.2.0"
