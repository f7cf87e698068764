"""Errors raised for bad user input: each says what is wrong and how to fix it."""


class DLoopError(Exception):
  """Base class of the errors this library raises on purpose."""


class ConfigError(DLoopError, ValueError):
  """A configuration value is invalid or unsupported."""


class ModelLoadError(DLoopError, OSError):
  """A model file or package is missing, truncated or corrupt."""


class PromptTooLongError(DLoopError, ValueError):
  """The prompt (plus the requested new tokens) does not fit the context window."""


class DrafterMismatchError(DLoopError, ValueError):
  """A drafter was built for another target model."""


class CheckpointFormatError(DLoopError, ValueError):
  """A drafter checkpoint's layout is unknown, or holds what our drafters cannot represent."""
