"""The one exception type for an expected mistake by the user (bad model name, existing --out, no GPU, ...).

The CLI prints its message as one line on stderr and exits 2; anything else is a bug and keeps its traceback.
"""


class UsageError(Exception):
    """A mistake the user can fix; the message says how."""
