"""The one exception of delta_codec: every refusal says which tensor and why."""


class DeltaError(ValueError):
    """A delta/keyframe that is malformed, corrupted, unsigned, or does not fit the target state."""
