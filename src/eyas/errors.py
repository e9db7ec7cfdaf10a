"""The one exception type for bad user input. The CLI prints it as one line and exits 2."""


class EyasError(ValueError):
    """Bad input or a refused operation; the message names the file/record and what was expected."""
