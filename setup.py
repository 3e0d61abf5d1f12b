"""Build script: everything is in setup.cfg except the C extension list.

``sandbox._memguard`` is optional: when it cannot be compiled the install
still succeeds and the pool falls back to tracemalloc (reported at start-up
and in ``pool.hardening``).
"""
from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "sandbox._memguard",
            sources=["sandbox/_memguard.c"],
            extra_compile_args=["-O2", "-std=gnu11"],
            optional=True,
        )
    ]
)
