"""The one exception of delta_codec: every refusal says which tensor and why."""


class DeltaError(ValueError):
    """A delta/keyframe that is malformed, corrupted, unsigned, or does not fit the target state."""


class NonFiniteError(DeltaError):
    """An update whose result holds NaN or ±inf (checked only where asked: `finite=True`). A
    worker refuses it as it refuses a bad digest: the state is left as it was."""
