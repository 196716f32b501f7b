"""The one error type users see: a message that says what to fix."""


class EplbError(Exception):
    """Bad input or an impossible request. The CLI prints it as one line and exits 2;
    the API turns it into a 422 problem detail."""
