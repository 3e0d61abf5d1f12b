"""Build script: everything is in setup.cfg except the C extension list.

Every extension is optional: when one cannot be compiled the install still
succeeds. Without ``sandbox._memguard`` the pool falls back to tracemalloc
(reported at start-up and in ``pool.hardening``); without ``sandbox._frameshape``
the pool measures workers' frames with the same walk in Python (slower); without
``sandbox._typepatch`` ``collections.deque.index`` stays CPython's (see
``sandbox/cpython_fixes.py``); without
``service.http._scan`` the records journal looks for the presented secret
with the same checks in Python (slower on the request path); without
``service.http._bodycount`` a large JSON body's values are counted with a
regular expression (slower).
"""
from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "sandbox._memguard",
            sources=["sandbox/_memguard.c"],
            extra_compile_args=["-O2", "-std=gnu11"],
            optional=True,
        ),
        Extension(
            "sandbox._unicode_errors",
            sources=["sandbox/_unicode_errors.c"],
            extra_compile_args=["-O2", "-std=gnu11"],
            optional=True,
        ),
        Extension(
            "sandbox._frameshape",
            sources=["sandbox/_frameshape.c"],
            extra_compile_args=["-O2", "-std=gnu11"],
            optional=True,
        ),
        Extension(
            "sandbox._datetime_state",
            sources=["sandbox/_datetime_state.c"],
            extra_compile_args=["-O2", "-std=gnu11"],
            optional=True,
        ),
        Extension(
            "sandbox._decimal_signals",
            sources=["sandbox/_decimal_signals.c"],
            extra_compile_args=["-O2", "-std=gnu11"],
            optional=True,
        ),
        Extension(
            "sandbox._typepatch",
            sources=["sandbox/_typepatch.c"],
            extra_compile_args=["-O2", "-std=gnu11"],
            optional=True,
        ),
        Extension(
            "service.http._scan",
            sources=["service/http/_scan.c"],
            extra_compile_args=["-O2", "-std=gnu11"],
            optional=True,
        ),
        Extension(
            "service.http._bodycount",
            sources=["service/http/_bodycount.c"],
            extra_compile_args=["-O2", "-std=gnu11"],
            optional=True,
        ),
    ]
)
