"""The library's version, in a module of its own so the runtime can read it without importing
the package's ``__init__`` (which imports the runtime: an import cycle)."""

__version__ = "0.1.0"
