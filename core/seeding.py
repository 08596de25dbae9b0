"""Seeds derived from the run's one seed (``seed_everything`` in the config) and the coordinates they are for:
the data order of an epoch, a parameter's initial value, a rank's dropout at a step. Both the data and the model
layer use it, so it sits below them."""

from __future__ import annotations

import hashlib


def derive_seed(*parts: int | str) -> int:
    """A 63-bit seed that depends on every part; nearby inputs give unrelated seeds."""
    digest = hashlib.sha256("/".join(str(part) for part in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1

DEFAULT_SEED = 1337  # fixed, not random: a resumed run must draw the same data, weights and dropout as the first
