"""Build script: everything is in setup.cfg except the C extension list.

Every extension is optional: when one cannot be compiled the install still
succeeds. Without ``sandbox._memguard`` the pool falls back to tracemalloc
(reported at start-up and in ``pool.hardening``); without ``sandbox._frameshape``
the pool measures workers' frames with the same walk in Python (slower); without
``sandbox._typepatch`` ``collections.deque.index`` stays CPython's (see
``sandbox/cpython_fixes.py``), and without ``sandbox._unicode_errors``,
``sandbox._datetime_state`` or ``sandbox._decimal_signals`` the CPython bug
each one closes stays open (a warning at start-up says so); without
``service.http._scan`` the records journal looks for the presented secret
with the same checks in Python (slower on the request path); without
``service.http._bodycount`` a large JSON body's values are counted with a
regular expression (slower).
"""
from setuptools import Extension, setup

#: The C extensions, by module name (the source is the module's path + ".c").
EXTENSIONS = ["sandbox._memguard", "sandbox._unicode_errors", "sandbox._frameshape",
              "sandbox._datetime_state", "sandbox._decimal_signals", "sandbox._typepatch",
              "service.http._scan", "service.http._bodycount"]

setup(
    ext_modules=[
        Extension(name, sources=[name.replace(".", "/") + ".c"],
                  extra_compile_args=["-O2", "-std=gnu11"], optional=True)
        for name in EXTENSIONS
    ]
)
