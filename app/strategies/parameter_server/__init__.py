"""Asynchronous training through a parameter server: the strategy, its messages, the server's side, the worker's."""
