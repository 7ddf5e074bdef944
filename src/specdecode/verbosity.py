"""What reaches the terminal during an ordinary command: its output, its errors and one progress bar per
download or conversion (long work a user should see moving) — not other libraries' warnings and log lines,
which a user can neither act on nor tell from our own messages.  ``--verbose`` shows them."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import warnings
from collections.abc import Iterator

_TRANSFORMERS_VERBOSITY = "TRANSFORMERS_VERBOSITY"
# True inside ``quiet_third_party(quiet=False)``.  Process-wide, like the environment variable above: a model
# may be fetched from a worker thread.
_shown = False


def third_party_output_shown() -> bool:
    """Whether other programs' output (pip's, when a model is fetched) may reach the terminal: only inside
    ``quiet_third_party(quiet=False)``, i.e. with ``--verbose``.  Outside the CLI (the Python API) it is hidden
    too: a library's caller did not ask for pip's chatter."""
    return _shown


@contextlib.contextmanager
def quiet_third_party(quiet: bool = True) -> Iterator[None]:
    """While the block runs (``quiet``): Python warnings are ignored unless the user asked for them with
    ``-W`` or ``PYTHONWARNINGS``, and transformers logs errors only — set now if it is imported, through its
    environment variable if it is imported later (its log level is read once, on import).  Not ``quiet``:
    other programs' output is shown too (:func:`third_party_output_shown`)."""
    global _shown
    if not quiet:
        saved_shown, _shown = _shown, True
        try:
            yield
        finally:
            _shown = saved_shown
        return
    saved_env = os.environ.get(_TRANSFORMERS_VERBOSITY)
    os.environ.setdefault(_TRANSFORMERS_VERBOSITY, "error")
    transformers_logging = sys.modules.get("transformers.utils.logging")
    saved_level = transformers_logging.get_verbosity() if transformers_logging else None
    if transformers_logging:
        transformers_logging.set_verbosity(logging.ERROR)
    try:
        with warnings.catch_warnings():
            if not sys.warnoptions:
                warnings.simplefilter("ignore")
            yield
    finally:
        if saved_env is None:
            os.environ.pop(_TRANSFORMERS_VERBOSITY, None)
        if transformers_logging and saved_level is not None:
            transformers_logging.set_verbosity(saved_level)
