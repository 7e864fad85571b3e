"""The base of every error ds_ext reports to a user.

Each ds_ext error class derives from :class:`DsExtError` (and keeps its ``ValueError`` /
``RuntimeError`` base), so a caller catches all of them with one ``except`` and the
``ds-ext`` command line prints any of them in one line with exit status 2. A built-in
``ValueError`` / ``RuntimeError`` / ``TypeError`` from ds_ext is an internal invariant, a
bug (``tests/test_cli.py`` lists where they stay).
"""


class DsExtError(Exception):
    """An error ds_ext reports in one line: bad configuration, arguments, topology, files."""


class DsExtConfigError(DsExtError, ValueError):
    """An invalid ``"ds_ext"`` block or ds_config; the message names the key path (raised by
    the schema, ``ds_ext.config``, and by the plugins below it)."""


class DsExtSetupError(DsExtError, RuntimeError):
    """A process not set up for what it was asked to do: no launcher variables, DeepSpeed's
    communication backend not started, no files to read."""


class MissingExtraError(DsExtError, ImportError):
    """A feature whose packages are an install extra (figures: matplotlib; benchmark statistics:
    scipy) used without them; the message names the extra."""


def require_extra(module: str, what: str) -> None:
    """Import ``module`` or raise :class:`MissingExtraError` naming ``pip install 'ds_ext[bench]'``."""
    import importlib

    try:
        importlib.import_module(module)
    except ImportError:
        raise MissingExtraError(
            f"{what}: {module.split('.')[0]} is not installed; it is an extra of ds_ext: pip install 'ds_ext[bench]'"
        ) from None
