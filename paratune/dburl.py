"""Database URLs (SQLAlchemy's ``dialect+driver://``) with a driver that is installed.

SQLAlchemy 2.1 reads a plain ``postgresql://`` as ``postgresql+psycopg://`` (psycopg 3); a
machine with only psycopg2 then fails with "Failed to import DB access module", which names
neither driver. :func:`with_installed_driver` picks the installed one, and
:func:`missing_driver` says which module a failed URL needs and how to install it.
"""

from __future__ import annotations

import importlib.util

__all__ = ["missing_driver", "with_installed_driver"]

# the drivers SQLAlchemy can use for a dialect named without one, preferred first, with the
# pip package of each
_DRIVERS = {"postgresql": (("psycopg", "psycopg[binary]"), ("psycopg2", "psycopg2-binary")),
            "postgres": (("psycopg", "psycopg[binary]"), ("psycopg2", "psycopg2-binary")),
            "mysql": (("MySQLdb", "mysqlclient"), ("pymysql", "pymysql"))}
_PACKAGES = {module: package for drivers in _DRIVERS.values() for module, package in drivers}
_PACKAGES.update({"pg8000": "pg8000", "asyncpg": "asyncpg", "mysql.connector":
                  "mysql-connector-python", "psycopg2cffi": "psycopg2cffi"})


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def with_installed_driver(url: str) -> str:
    """``url`` with the driver spelt out where it names a dialect only and SQLAlchemy's
    default driver for it is not installed but another is (``postgresql://`` becomes
    ``postgresql+psycopg2://`` where only psycopg2 is there); any other URL unchanged."""
    scheme, sep, rest = url.partition("://")
    if not sep or "+" in scheme or scheme.lower() not in _DRIVERS:
        return url
    drivers = _DRIVERS[scheme.lower()]
    if _installed(drivers[0][0]):
        return url
    for module, _ in drivers[1:]:
        if _installed(module):
            return f"{'postgresql' if scheme.lower() == 'postgres' else scheme}+{module}://{rest}"
    return url


def missing_driver(url: str, exc: BaseException) -> str:
    """What to install for ``url``, from the import error ``exc`` it raised: ``"the Python
    module psycopg (pip install 'psycopg[binary]' or 'psycopg2-binary')"``."""
    names = []
    current: BaseException | None = exc
    while current is not None and len(names) < 8:
        name = getattr(current, "name", None)
        if isinstance(current, ImportError) and name:
            names.append(name)
        current = current.__cause__ or current.__context__
    scheme = url.partition("://")[0].lower()
    dialect, _, driver = scheme.partition("+")
    module = names[0] if names else driver or None
    choices = ([package for _, package in _DRIVERS[dialect]] if not driver and dialect in _DRIVERS
               else [_PACKAGES.get(module or "", module or "")])
    choices = [c for c in choices if c]
    install = " or ".join(f"pip install '{c}'" for c in choices)
    what = f"the Python module {module}" if module else "a database driver"
    return f"{what}, which is not installed ({install})" if install else \
        f"{what}, which is not installed"
