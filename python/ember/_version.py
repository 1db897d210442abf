"""Ember's version: the one place it is written.

pyproject.toml reads it (setuptools' dynamic version), setup.py compiles it
into the C extension (EMBER_VERSION), the Makefile writes it into ember.pc,
and the Maven builds get it as -Drevision.
"""

__version__ = "0.2.0"
