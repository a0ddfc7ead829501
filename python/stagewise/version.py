"""The package's version, in a module of its own: what other hosts' stagewise is compared with
(``stagewise doctor``), importable without the rest of the package."""

__version__ = "0.1.0"
