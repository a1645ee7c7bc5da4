"""Integrations of the fused GDN decode op with model libraries.

Each submodule imports its library on import; import the one you use, e.g.
``from custom_ops.integrations.transformers import patch_gdn_decode``.
"""
