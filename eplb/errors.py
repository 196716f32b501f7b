"""The one error type users see: a message that says what to fix."""

from __future__ import annotations

import re
from collections.abc import Iterable


class EplbError(Exception):
    """Bad input or an impossible request. The CLI prints it as one line and exits 2;
    the API turns it into a 422 problem detail."""


class FieldError(EplbError):
    """Bad input in named fields of a request, a deployment's config, a window or an applied placement: `fields`,
    the dotted paths into the JSON (`cluster.gpus_per_node`; one or several), share one `message`. The text is
    'field, field: message', or `text` when the message names what it is about itself ('loads[0][1] is -2: ...').
    The service's 422 lists each field with the message in `errors` (`api.problems.field_problem`), as for every
    other 422."""

    def __init__(self, fields: str | Iterable[str], message: str, text: str | None = None) -> None:
        self.fields: tuple[str, ...] = (fields,) if isinstance(fields, str) else tuple(fields)
        self.message = message
        super().__init__(text if text is not None else f"{', '.join(self.fields)}: {message}")

    def __reduce__(self) -> tuple[type[FieldError], tuple[tuple[str, ...], str, str]]:
        """Pickled with its fields and message (args holds the text only): it crosses the solver processes."""
        return (type(self), (self.fields, self.message, str(self)))


SETTING_REFUSED = "eplb_setting"
"""The pydantic error type of a setting a validator of ours refuses (`api.settings`): its message says what is
accepted, whole; `eplb.cli.settings_error` puts it after where the value came from."""
SECRET_REFUSED = "eplb_secret_setting"
"""As `SETTING_REFUSED`, for a secret (`EPLB_API_KEY`): `eplb.cli.settings_error` names where it came from, never
the value."""


def clip(text: str, width: int = 40) -> str:
    """`text` as it fits in `width` characters: cut, its last character an ellipsis, when longer (a name a message
    or a table cell echoes)."""
    return text if len(text) <= width else text[: width - 1] + "\u2026"


_UNPRINTABLE = re.compile("[\x00-\x1f\x7f\udc80-\udcff]")


def one_line(text: str) -> str:
    """`text` for one terminal line: a control character (a line break in a file name) as Python escapes it (`\\n`),
    an undecodable byte of a file name (a surrogate escape) as that byte (`\\xff`)."""
    return _UNPRINTABLE.sub(lambda m: f"\\x{ord(m[0]) - 0xDC00:02x}" if m[0] >= "\udc80" else repr(m[0])[1:-1], text)


def single_spaced(message: object) -> str:
    """Another library's message (an exception's) for one line: each run of whitespace, its line breaks too, as one
    space (Ray's 'either:\n  1. Unset RAY_ADDRESS ...' read as '\n' escapes through `one_line`)."""
    return " ".join(str(message).split())


def shown(value: object, width: int = 40) -> str:
    """`value` for a message: repr of a string (clipped to `width` characters, with its length when cut), else str.
    The CLI's messages and the service's (a deployment name, a path) echo what they were given through it."""
    if not isinstance(value, str):
        return str(value)
    return repr(value) if len(value) <= width else f"{clip(value, width)!r} ({len(value):,} characters)"
