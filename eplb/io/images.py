"""Images eplb writes to a path the user names (`eplb cost --plot`, `eplb history --plot`): one rule for both,
written exactly as named, in the format its suffix names."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from eplb.errors import EplbError, clip, shown
from eplb.io.files import output_file

if TYPE_CHECKING:  # matplotlib is imported when a figure is drawn, not at every start-up
    from matplotlib.figure import Figure

IMAGE_HELP = ("written as named: PNG, or the format its suffix names (.svg, .pdf, .jpg, ...: those matplotlib "
              "writes); another suffix is refused")
"""What a --plot FILE flag's help says of FILE."""


def image_format(path: str | Path, name: str = "plot") -> str:
    """The format an image is written to `path` in: its suffix's (in any case) when matplotlib writes it, PNG for
    a name without one; no suffix is added (the file is `path`). EplbError naming `name` (the CLI: its flag) for
    an empty name, a directory, a missing directory, or another suffix (listing those matplotlib writes). Call it
    before the work the image shows."""
    from matplotlib.backend_bases import FigureCanvasBase

    text = str(path)
    if not text:
        raise EplbError(f"{name}: give a file name for the image")
    output_file(text, name)
    suffix = Path(text).suffix.lower().removeprefix(".")
    if not suffix:
        return "png"
    formats = FigureCanvasBase.get_supported_filetypes()
    if suffix not in formats:
        raise EplbError(f"{name} {shown(text)}: .{clip(suffix, 20)} is no image format matplotlib writes; give a "
                        f"name ending in .png (or {', '.join('.' + f for f in formats if f != 'png')}), or none "
                        "for PNG")
    return suffix


def save_figure(fig: Figure, path: str | Path, name: str = "plot", dpi: int = 120) -> str:
    """Write `fig` to `path`, exactly, in `image_format(path, name)`, and close it; returns the format. EplbError,
    naming `name` and the path, when it cannot be written."""
    import matplotlib.pyplot as plt

    try:
        image = image_format(path, name)
        fig.savefig(path, format=image, dpi=dpi)
    except OSError as exc:
        raise EplbError(f"{name} {shown(str(path))}: cannot write it ({exc.strerror or exc})") from None
    except RuntimeError as exc:  # a format that needs a missing tool: .pgf without LaTeX
        raise EplbError(f"{name} {shown(str(path))}: cannot write it ({exc})") from None
    finally:
        plt.close(fig)
    return image
