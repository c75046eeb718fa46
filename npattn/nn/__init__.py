"""Attention modules with parameters, caches and state dicts: not implemented yet.

They will be built only from :mod:`npattn.autograd` functions.
"""
