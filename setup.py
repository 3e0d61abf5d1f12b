"""Build script: everything is in setup.cfg except the C extension list."""
from setuptools import setup

setup()
