"""The sandbox: script language, restricted policy and the supervised worker pool.

This package has no Tornado or database imports.
"""
