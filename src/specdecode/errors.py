"""User-facing errors.

Anything a user can cause (bad prompt, bad parameter, unknown model, mismatched vocabularies,
corrupted cache) raises :class:`SpecDecodeError` with a one-line message.  The CLI prints that line
and exits non-zero; the server turns it into a 400.  Everything else is a bug and keeps its traceback.
"""


class SpecDecodeError(Exception):
    """A problem with the user's input or environment, explained in one line."""


class UnknownModelError(SpecDecodeError):
    """The model name is neither a registered short name, a local path, nor a loadable hub id."""


class UnknownDrafterError(SpecDecodeError):
    """No drafter is registered under that name."""


class VocabularyMismatchError(SpecDecodeError):
    """The draft model's tokenizer differs from the target's."""


class CorruptModelError(SpecDecodeError):
    """A downloaded or cached model file does not match its recorded SHA-256."""
