"""eagle3-ray: Ray-native training of EAGLE-3 speculative-decoding drafters."""

__version__ = "0.1.0"

# Libraries whose versions `eagle3-ray --version` reports beside this package's (for bug reports).
_REPORTED = ("ray", "torch", "deepspeed", "transformers", "sglang")


def version_text() -> str:
    """``eagle3-ray --version``: this package's version, Python's and the installed versions of the libraries
    a run rests on (read from their package metadata: nothing is imported)."""
    import platform
    from importlib import metadata

    found = []
    for name in _REPORTED:
        try:
            found.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            continue
    return f"eagle3-ray {__version__} (Python {platform.python_version()}; {', '.join(found)})"
