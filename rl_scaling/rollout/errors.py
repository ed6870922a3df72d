"""The one error the rollout side raises into the trainer (no imports: every rollout module can use it)."""


class RolloutError(RuntimeError):
    """The rollout generator, engine or server failed; the message says which and why."""
