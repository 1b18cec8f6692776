"""Text shared by the generated modules' headers."""


def docstring_safe(text: str) -> str:
    """A file name inside the header docstring: its repr without the quotes (escapes quotes,
    backslashes and newlines), so no path can end the docstring."""
    return repr(text)[1:-1].replace('"', '\\"')
