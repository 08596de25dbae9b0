"""Token ids whose meaning the data and the models share."""

IGNORE_INDEX = -100  # a target id the loss skips (padding); torch's cross-entropy default
