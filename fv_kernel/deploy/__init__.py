"""A running deployment from a deploy config: the engine and its instances, a parallel pool's ranks,
and the model a command names."""
