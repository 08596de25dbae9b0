"""Asynchronous training through a parameter server: the strategy, its settings, its messages, the server's side,
the worker's."""
