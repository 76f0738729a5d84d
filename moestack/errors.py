"""The one exception type for bad user input (files, data, checkpoints).

Entry points catch it (and ValueError from configs) and print a single line naming the
problem and its fix instead of a traceback.
"""


class MoestackError(Exception):
    """A user-facing error: the message names the bad file, field or value and the fix."""
