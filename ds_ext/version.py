"""The ds_ext release (a leaf: modules below the package's entry points read it from here)."""

__version__ = "0.1.0"
